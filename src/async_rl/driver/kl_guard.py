"""Warn when the trained policy has moved far from the policy that sampled the batch (issue 19; spec §1, §3).

``actor/ppo_kl`` is the k1 estimate ``mean_t (log π_{r,v_t}(a_t|s_t) - log π_θ(a_t|s_t))`` over the batch's model
tokens, i.e. KL(behaviour || current) measured on the very ratio ρ_t the policy loss uses. Under in-flight
training it grows with policy lag x actor lr; DIS (spec §3) has no trust region inside its band (0.7, 6.0), so
a large KL there is the precursor of the collapse measured in benchmarks/results/stability_map.json
(docs/algorithms.md, "Stability"). The guard does not change the update: it prints one WARNING line per step
over ``algorithm.kl_warn_threshold`` and logs ``actor/kl_warning`` (1 over, 0 under) on every actor update.

For the DIS losses a step counts as over only if ``actor/dis_kept_kl``, the KL on the tokens inside the band,
also exceeds ``algorithm.kl_warn_kept_threshold``: ``actor/ppo_kl`` counts the masked tokens too, and a few
whose probability collapsed can push it over the threshold while the band gives them no gradient (the demo's
Li2SAO run: ``actor/ppo_kl`` 0.169 with 0.011 inside the band, no dip). Replayed on the stability map of
47f8814 (benchmarks/results/kl_guard_replay.json), this rule warned before 5 of the 7 dips and on no run at
actor lr 3e-4.
"""

from __future__ import annotations

import math
import sys
from typing import Optional, TextIO

KL_METRIC = "actor/ppo_kl"
KEPT_KL_METRIC = "actor/dis_kept_kl"
WARNING_METRIC = "actor/kl_warning"


class KLGuard:
    """Checks one step's metrics against ``threshold`` (0 disables the guard) and, where the step reports
    ``actor/dis_kept_kl``, against ``kept_threshold`` too (0: ``actor/ppo_kl`` alone)."""

    def __init__(self, threshold: float, stream: Optional[TextIO] = None, kept_threshold: float = 0.0):
        if not threshold >= 0:
            raise ValueError(f"algorithm.kl_warn_threshold={threshold}: must be >= 0 (0 turns the warning off)")
        if not kept_threshold >= 0:
            raise ValueError(f"algorithm.kl_warn_kept_threshold={kept_threshold}: must be >= 0 "
                             "(0 warns on actor/ppo_kl alone)")
        self.threshold = float(threshold)
        self.kept_threshold = float(kept_threshold)
        self.stream = stream
        self.warned_steps: list[int] = []

    def check(self, step: int, metrics: dict) -> dict[str, float]:
        """``{"actor/kl_warning": 0/1}`` when the step updated the actor with a finite KL, else ``{}``; prints the
        WARNING line (to ``stream``, default stderr) when the KL is over the threshold."""
        kl = metrics.get(KL_METRIC)
        if not self.threshold or kl is None or not math.isfinite(float(kl)) or not metrics.get("actor/updated"):
            return {}
        over = float(kl) > self.threshold
        kept = metrics.get(KEPT_KL_METRIC)
        if over and self.kept_threshold and kept is not None and math.isfinite(float(kept)):
            over = float(kept) > self.kept_threshold  # a spike on masked tokens only carries no gradient
        if over:
            self.warned_steps.append(int(step))
            print(warning_line(step, float(kl), self.threshold, metrics, self.kept_threshold),
                  file=self.stream or sys.stderr, flush=True)
        return {WARNING_METRIC: float(over)}


def warning_line(step: int, kl: float, threshold: float, metrics: dict, kept_threshold: float = 0.0) -> str:
    """One line: the step, the KL against the threshold, the lag behind it and what to try."""
    lag = metrics.get("async/policy_lag/mean")
    lag_text = f", mean policy lag {lag:.2f}" if isinstance(lag, (int, float)) and math.isfinite(lag) else ""
    kept = metrics.get(KEPT_KL_METRIC)
    dis_loss = isinstance(kept, (int, float)) and math.isfinite(kept)
    if dis_loss:  # the drift where gradient flows
        lag_text += f", {KEPT_KL_METRIC} {kept:.4f} on the tokens inside the DIS band" + (
            f" > algorithm.kl_warn_kept_threshold {kept_threshold:g}" if kept_threshold else "")
    head = (f"WARNING: step {step}: actor/ppo_kl {kl:.4f} > algorithm.kl_warn_threshold {threshold:g}{lag_text}: "
            "the trained policy is far from the one that sampled this batch")
    if dis_loss:
        return (head + ", the regime where DIS collapsed (docs/algorithms.md, Stability); try a lower "
                "algorithm.actor_lr, a smaller trainer.driver.staleness_cap, or algorithm.policy_loss=dis_clip")
    # clipped losses: the ratio is bounded, but steps this large were not measured to be safe
    return (head + " (docs/algorithms.md, Stability); try a lower algorithm.actor_lr or a smaller "
            "trainer.driver.staleness_cap")
