"""Which phases of its algorithm a run actually went through, read from its metrics history.

A run that exits 0 but never rewarded anything, never updated the actor, never switched or never called a
tool proves only the plumbing. ``phase_report`` says, per phase the algorithm and task stand for, whether it
happened and how often; ``train.py`` writes it into ``summary.json`` and prints a warning for every phase
that did not happen.
"""

from __future__ import annotations

import math
from typing import Any, Optional

from async_rl.config import ALGORITHM_PLANS

# envs whose episodes are meant to have several model turns
MULTI_TURN_ENVS = ("toy_keys", "retool", "alfworld", "webshop")


def _values(history: list[dict], key: str) -> list[float]:
    out = []
    for row in history:
        value = row.get(key)
        if isinstance(value, (int, float)) and not math.isnan(float(value)):
            out.append(float(value))
    return out


# a collapse (issue 19): success reached COLLAPSE_HIGH, then stayed below COLLAPSE_LOW for COLLAPSE_STEPS steps
COLLAPSE_HIGH, COLLAPSE_LOW, COLLAPSE_STEPS = 0.9, 0.5, 5


def collapse_step(success: list[float], high: float = COLLAPSE_HIGH, low: float = COLLAPSE_LOW,
                  run: int = COLLAPSE_STEPS) -> Optional[int]:
    """1-based step where a collapse begins: the first of ``run`` consecutive steps below ``low`` after the
    success first reached ``high``; None when there is none (benchmarks/stability_map.py, tests/test_learning.py)."""
    reached = False
    streak = 0
    for i, value in enumerate(success):
        if not reached:
            reached = value >= high
            continue
        streak = streak + 1 if value < low else 0
        if streak >= run:
            return i + 2 - run
    return None


def phase_report(history: list[dict], algorithm: str, env_name: str,
                 switch_step: Optional[int] = None, switch_forced: Optional[bool] = None) -> dict[str, Any]:
    """``{"phases": {name: {"ran": bool, ...}}, "warnings": [str, ...]}`` for one run.

    Phases: ``reward`` (some batch had a reward > 0), ``actor_updates`` (optimizer steps of the policy),
    ``multi_turn`` (mean turns > 1 in some batch, i.e. some episode took 2+ turns; multi-turn envs), ``tool_calls`` (ReTool: code executed in
    the sandbox), ``critic_updates`` (LiSAO/Li2SAO/PPO), ``li2sao_switch`` (the switch happened; says whether
    the gate opened on evidence or was forced at T_max), ``sapo_value_losses`` (SAPO's V and Q losses).
    """
    phases: dict[str, dict[str, Any]] = {}
    rewards = _values(history, "train/reward_mean")
    phases["reward"] = {"ran": any(r > 0 for r in rewards),
                        "steps_with_reward": sum(1 for r in rewards if r > 0)}
    updates = _values(history, "actor/updated")
    phases["actor_updates"] = {"ran": sum(updates) > 0, "count": int(sum(updates))}
    if env_name in MULTI_TURN_ENVS:
        turns = _values(history, "train/num_turns/mean")
        phases["multi_turn"] = {"ran": any(t > 1 for t in turns), "max_mean_turns": max(turns, default=0.0)}
    if env_name == "retool":
        calls = _values(history, "train/tool_calls")
        phases["tool_calls"] = {"ran": sum(calls) > 0, "count": int(sum(calls))}
    plan = ALGORITHM_PLANS.get(algorithm)  # what the algorithm is made of (a run of an unknown one: no such phases)
    if plan is not None and plan.trains_critic:
        losses = _values(history, "critic/value_loss")
        phases["critic_updates"] = {"ran": bool(losses), "steps": len(losses)}
    if plan is not None and plan.gated:
        phases["li2sao_switch"] = {"ran": switch_step is not None, "step": switch_step,
                                   "gate_opened_on_evidence": None if switch_step is None else not switch_forced}
    if plan is not None and plan.shared_backbone:
        v, q = _values(history, "sapo/v_loss"), _values(history, "sapo/q_loss")
        phases["sapo_value_losses"] = {"ran": bool(v) and bool(q), "steps": min(len(v), len(q))}

    warnings = []
    for name, info in phases.items():
        if not info["ran"]:
            warnings.append(f"phase '{name}' never happened in this run ({_HINTS[name]})")
    switch = phases.get("li2sao_switch")
    if switch and switch["ran"] and switch["gate_opened_on_evidence"] is False:
        warnings.append("Li2SAO's switch was forced at T_max: the readiness gate never opened on evidence")
    over = [row for row in history if row.get("actor/kl_warning") == 1.0]
    if over:  # async_rl.driver.kl_guard: the regime where DIS collapsed (docs/algorithms.md, Stability)
        peak = max(float(row["actor/ppo_kl"]) for row in over)
        warnings.append(f"actor/ppo_kl exceeded algorithm.kl_warn_threshold on {len(over)} of {int(sum(updates))} "
                        f"actor updates (first at step {int(over[0].get('trainer/step', 0))}, peak {peak:.3f}): "
                        "lower algorithm.actor_lr or trainer.driver.staleness_cap")
    return {"phases": phases, "warnings": warnings}


_HINTS = {
    "reward": "every reward was 0: nothing was learned; warm-start the model or use an easier task",
    "actor_updates": "the actor never stepped: is critic_warmup_steps longer than total_steps?",
    "multi_turn": "every episode ended after one turn: check max_response_tokens / the context against the prompt",
    "tool_calls": "the model never wrote code, so the sandbox never ran",
    "critic_updates": "the critic never trained",
    "li2sao_switch": "no switch to single rollout: total_steps ends before T_max and the gate never opened",
    "sapo_value_losses": "SAPO's V/Q losses were never computed",
}
