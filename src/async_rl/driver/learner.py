"""One training step per batch (spec §2-§5): the algorithm's estimator, critic passes, actor update, Li2SAO's
gate. Reads top to bottom; the equations live in :mod:`async_rl.algos`. The estimator and the policy loss are
looked up in verl's registries (``get_adv_estimator_fn``, ``get_policy_loss_fn`` in the roles) by the names of
the algorithm's plan (:data:`async_rl.config.ALGORITHM_PLANS`), and called with the critic's values and the batch tensors
as keyword arguments.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from verl.trainer.ppo.core_algos import get_adv_estimator_fn

import async_rl.verl_plugin  # noqa: F401  (our estimators and losses are in verl's registries before any lookup)
from async_rl.algos import ReadinessGate
from async_rl.algos.estimate import AdvantageEstimate
from async_rl.algos.sapo import sapo_update_targets
from async_rl.config import plan_for
from async_rl.config import AlgorithmConfig
from async_rl.driver.batch import batch_metrics, collate, mark_current_version, turn_tensors
from async_rl.driver.kl_guard import KLGuard
from async_rl.driver.trajectory import Trajectory
from async_rl.driver.roles import PolicyRole, SharedBackboneRole, ValueRole


def estimate_advantages(estimator: str, batch: dict, group_ids: list, cfg,
                        **extra) -> AdvantageEstimate:
    """The registered estimator ``estimator`` (verl's ``get_adv_estimator_fn``) on one collated batch: verl's
    keyword arguments, the batch fields our estimators read, and ``extra`` (the critic's ``values``, SAPO's turn
    tensors and readouts)."""
    estimate = get_adv_estimator_fn(estimator)(
        token_level_rewards=batch["token_level_rewards"], response_mask=batch["response_mask"], index=group_ids,
        config=cfg, scores=batch.get("scores"), responses=batch.get("responses"),
        response_attention=batch.get("response_attention"), **extra)
    if not isinstance(estimate, AdvantageEstimate):
        raise TypeError(f"estimator {estimator!r} returned {type(estimate).__name__}; the trainer needs an "
                        "async_rl.algos.estimate.AdvantageEstimate (critic targets, mask, metrics)")
    return estimate


def shared_backbone_targets(actor: SharedBackboneRole, batch: dict, turns: dict, cfg,
                            estimator: str = "sapo_turn", group_ids: Optional[list] = None
                            ) -> tuple[AdvantageEstimate, dict]:
    """SAPO's side of a step (spec §5): the backbone's frozen readouts (its V and Q, as a critic's ``values``), the
    registered ``estimator`` on them and the batch's turn tensors (``driver.batch.turn_tensors``), and the frozen
    targets of the update. ``cfg``: the algorithm's settings (``gamma``, ``sapo_lambda``, ``sapo_invalid_penalty``;
    an AlgorithmConfig or a dict). Returns ``(estimate, targets)``."""
    rows = int(batch["response_mask"].shape[0])
    if turns["turn_mask"].shape[0] != rows:
        raise ValueError(f"turn tensors have {turns['turn_mask'].shape[0]} rows, the batch {rows}: build them from "
                         f"the same trajectories (driver.batch.turn_tensors)")
    readouts = actor.readouts(batch, int(turns["turn_mask"].shape[1]))
    estimate = estimate_advantages(
        estimator, batch, list(group_ids or []), cfg, turn_rewards=turns["turn_rewards"],
        turn_dones=turns["turn_dones"], turn_mask=turns["turn_mask"].float() * readouts["turn_mask"],
        invalid_action=turns.get("turn_invalid"), old_turn_values=readouts["values"],
        old_turn_q_values=readouts["q_values"], token_turn_index=batch["token_turn_index"])
    return estimate, sapo_update_targets(readouts, estimate)


@dataclass
class StepResult:
    """One training step: its metrics, and the two facts the driver acts on (kept out of the metrics dict)."""

    metrics: dict[str, float]
    actor_updated: bool  # the actor took an optimizer step: publish (False in LiSAO's critic warm-up)
    gate_opened: bool = False  # Li2SAO's readiness gate opened on this step: begin the switch (spec §4)


class Learner:
    """Owns the actor (and critic), the policy version, and Li2SAO's phase and readiness gate."""

    def __init__(self, cfg: AlgorithmConfig, actor: PolicyRole | SharedBackboneRole, critic: Optional[ValueRole],
                 pad_token_id: int):
        cfg.validate()
        if cfg.use_critic and critic is None:
            raise ValueError(f"{cfg.name} needs a critic")
        self.cfg = cfg
        self.actor = actor
        self.critic = critic
        self.pad_token_id = pad_token_id
        self.policy_version = 0  # number of actor updates so far = version of the trainer's weights
        self.step = 0  # batches consumed
        self.plan = plan_for(cfg.name)
        self.phase = "bootstrap" if self.plan.gated else "main"
        self.gate = ReadinessGate(**vars(cfg.gate)) if self.plan.gated else None
        self.kl_guard = KLGuard(cfg.kl_warn_threshold, kept_threshold=cfg.kl_warn_kept_threshold)
        # checkpoints: None = sharded model state exactly for worker-group trainers (see model_state_sharded)
        self.shard_model_state: Optional[bool] = None

    # ------------------------------------------------------------------ the step
    def train_step(self, trajectories: list[Trajectory]) -> StepResult:
        """Consume one batch; returns its metrics and whether to publish or begin the Li2SAO switch."""
        cfg = self.cfg
        batch = collate(trajectories, self.pad_token_id)
        group_ids = [t.group_id for t in trajectories]
        group_sizes = {t.group_size for t in trajectories}
        if len(group_sizes) != 1:
            raise RuntimeError(f"a batch mixed group sizes {sorted(group_sizes)}; the buffer must prevent this")
        # spec §4, App. F.3: the group estimator only when the largest prompt group in this batch still has more
        # than one response (aborts can leave every group a single survivor, whose group advantage is 0)
        grouped = group_sizes.pop() > 1 and max(Counter(group_ids).values()) > 1
        metrics = batch_metrics(trajectories, batch, self.policy_version)
        if self.plan.shared_backbone:  # SAPO (spec §5): V and Q are read from the policy's own backbone
            return self._shared_backbone_step(trajectories, batch, group_ids, metrics)

        old_values = self.critic.values(batch) if self.critic is not None else None
        estimator = self.plan.grouped_estimator if grouped else self.plan.single_estimator
        estimate = estimate_advantages(estimator, batch, group_ids, cfg, values=old_values)
        metrics.update(estimate.metrics)

        # ---------------- critic: K passes with V_old frozen once per batch ----------------------------
        if self.critic is not None:
            if estimate.critic_targets is None:
                raise RuntimeError(f"estimator {estimator!r} gives no critic targets, but {cfg.name} has a critic")
            for _ in range(cfg.critic_updates_per_batch):
                critic_metrics = self.critic.update(batch, estimate.critic_targets, estimate.critic_mask,
                                                    old_values, estimate.value_clip, estimate.ranking)
            metrics.update(critic_metrics)

        # ---------------- actor -----------------------------------------------------------------------
        frozen = self.step < cfg.critic_warmup_steps
        if not frozen:
            loss_mode = self._policy_loss()
            mark_current_version(batch, self.policy_version)
            metrics.update(self.actor.update(batch, estimate.advantages, loss_mode, cfg.clip.clip_ratio_low,
                                             cfg.clip.clip_ratio_high, cfg.dis.low, cfg.dis.high,
                                             loss_agg_mode=cfg.loss_agg_mode))
            self.policy_version += 1
        metrics["actor/updated"] = float(not frozen)
        self.step += 1
        metrics.update(self.kl_guard.check(self.step, metrics))

        # ---------------- Li2SAO gate (decided on this step's statistics; the driver switches) ----------
        gate_opened = False
        if self.gate is not None and self.phase == "bootstrap" and grouped:
            gate_opened = self.gate.update(metrics.get("li2sao/explained_var_residual"),
                                           metrics.get("li2sao/rank_acc"))
            if gate_opened:
                metrics["li2sao/gate_opened"] = 1.0  # for the plots and the dashboard
            metrics.update(self.gate.metrics())
        metrics["trainer/step"] = float(self.step)
        metrics["trainer/policy_version"] = float(self.policy_version)
        return StepResult(metrics, actor_updated=not frozen, gate_opened=bool(gate_opened))

    def _shared_backbone_step(self, trajectories: list[Trajectory], batch, group_ids: list, metrics: dict
                              ) -> StepResult:
        """SAPO (spec §5): the estimator on the backbone's frozen readouts, then one joint backward."""
        cfg = self.cfg
        turns = turn_tensors(trajectories)  # built here: the driver holds the trajectories
        estimate, targets = shared_backbone_targets(self.actor, batch, turns, cfg, self.plan.single_estimator,
                                                    group_ids)
        metrics.update(estimate.metrics)
        metrics.update(self.actor.update(batch, turns, targets, clip_eps=cfg.clip.clip_ratio_low,
                                         clip_v=cfg.sapo_clip_v, clip_q=cfg.sapo_clip_q, c_v=cfg.sapo_c_v,
                                         c_q=cfg.sapo_c_q, c_h=cfg.sapo_c_h, kl_coef=cfg.sapo_kl_coef))
        self.policy_version += 1
        self.step += 1
        metrics["actor/updated"] = 1.0
        metrics.update(self.kl_guard.check(self.step, metrics))
        metrics["trainer/step"] = float(self.step)
        metrics["trainer/policy_version"] = float(self.policy_version)
        return StepResult(metrics, actor_updated=True)

    def _policy_loss(self) -> str:
        phase_loss = self.plan.bootstrap_loss if self.phase == "bootstrap" else self.plan.single_loss
        return phase_loss or self.cfg.policy_loss

    def switch_to_single_rollout(self) -> None:
        """Li2SAO's one-way switch (spec §4): called by the driver once the prefetched job is done."""
        self.phase = "single"

    # ------------------------------------------------------------------ checkpointing
    @property
    def model_state_sharded(self) -> bool:
        """True when actor and critic are worker groups (``trainer.workers=ray``): their model and optimizer
        state goes to a sharded directory (:meth:`save_model_shards`, every rank its shard) next to the
        driver-state file instead of into it; in-process roles put full state dicts into it, unless
        :attr:`shard_model_state` is set (their engines save shards as one rank)."""
        if self.shard_model_state is not None:
            return bool(self.shard_model_state)
        return bool(self.actor.saves_sharded)

    def state_dict(self) -> dict:
        """Counters, phase and gate; plus full model/optimizer state unless :attr:`model_state_sharded`."""
        state = {
            "policy_version": self.policy_version, "step": self.step, "phase": self.phase,
            "gate": self.gate.state_dict() if self.gate else None,
        }
        if self.model_state_sharded:
            state["model_state"] = "sharded"
            state["train_world_size"] = int(self.actor.world_size)
            return state
        state["model_state"] = "full"
        for name, role in self._roles():
            full = role.state_dict()
            state[f"{name}_model"], state[f"{name}_optim"] = full["model"], full["optim"]
        return state

    def save_model_shards(self, directory: Path) -> None:
        """Actor (and critic) model + AdamW state, sharded, under ``directory/actor`` (``/critic``)."""
        for name, role in self._roles():
            role.save_sharded(Path(directory) / name)

    def load_state_dict(self, state: dict, shards_dir: Optional[str | Path] = None) -> None:
        """Restore; ``shards_dir`` is where a checkpoint with sharded model state keeps it.

        Either kind loads into either kind of trainer: full state dicts go to worker groups through rank 0
        (``load_state_dict``, scattered to every rank), shards load into an in-process engine as one rank
        (torch.distributed.checkpoint reshards). A different number of train ranks reshards the same way.
        """
        saved_as = state.get("model_state", "full")
        if saved_as == "sharded" and shards_dir is None:
            raise ValueError("the checkpoint keeps its model state in a shard directory and none was given")
        if saved_as == "sharded":
            for name in ("actor", "critic") if self.critic is not None else ("actor",):
                if not (Path(shards_dir) / name).is_dir():
                    raise ValueError(f"the checkpoint has no {name} shards ({Path(shards_dir) / name} is missing)")
        self.policy_version = state["policy_version"]
        self.step = state["step"]
        self.phase = state["phase"]
        if state["gate"] is not None:
            self.gate = ReadinessGate.from_state_dict(state["gate"])
        saved_ranks = state.get("train_world_size")
        ranks_now = int(self.actor.world_size)
        if saved_ranks is not None and int(saved_ranks) != ranks_now:
            print(f"resume: resharding the model and optimizer state saved on {saved_ranks} train rank(s) onto "
                  f"{ranks_now}", flush=True)
        for name, role in self._roles():
            if saved_as == "sharded":
                role.load_sharded(Path(shards_dir) / name)
            else:  # in process: into the engine; a worker group: rank 0 scatters the full state
                role.load_state_dict({"model": state[f"{name}_model"], "optim": state[f"{name}_optim"]})

    def _roles(self) -> list[tuple[str, object]]:
        """The trained roles by checkpoint name; each meets driver/roles.py's checkpoint calls."""
        return [("actor", self.actor)] + ([("critic", self.critic)] if self.critic is not None else [])
