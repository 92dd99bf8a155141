"""Actor and critic roles: a model, an optimizer (through the engine) and the algorithm calls.

These classes hold no Ray or scheduling logic: the driver uses them in-process (deterministic mode) and
the verl ``Worker`` classes in :mod:`async_rl.workers.train_workers` wrap them for Ray worker groups.
Losses are built as *local sums* and divided by counts summed over the data-parallel group
(:meth:`TrainEngine.global_denominator`), so two workers on half batches give the full-batch gradient.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import torch
from omegaconf import OmegaConf

from async_rl.algos import (
    clipped_value_loss,
    loss_normaliser_count,
    squared_value_loss,
    terminal_ranking_loss,
    values_at_last_model_token,
)
from async_rl.algos.dis import DIS_HIGH, DIS_LOW
from async_rl.algos.metrics import MISMATCH_METRIC_KEYS, mismatch_metrics, mismatch_sums
from async_rl.algos.policy import CLIP_HIGH, CLIP_LOW
from async_rl.config import POLICY_LOSSES
from async_rl.engine import dist
from async_rl.engine.base import GlobalDenominator, OptimizerConfig
from async_rl.engine.fsdp import FSDPEngine
from async_rl.engine.microbatch import MicroBatchPlan
from async_rl.models.critic import CriticModel
from async_rl.models.loading import load_causal_lm
from async_rl.models.logprobs import DEFAULT_LOGITS_CHUNK_TOKENS, response_token_logprobs
from async_rl.workers.proto import MODEL_INPUT_KEYS
from async_rl.workers.role_calls import ARG_PREFIX, RemoteCall


def model_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(input_ids (bs, P+T), attention_mask (bs, P+T), T)`` from a collated batch."""
    input_ids = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    attention = torch.cat([batch["prompt_mask"], batch["response_attention"]], dim=1)
    return input_ids, attention, batch["responses"].shape[1]


def _micro_batches(batch: dict[str, torch.Tensor], plan: MicroBatchPlan) -> list[torch.Tensor]:
    """Consecutive row-index groups under the plan's token budget / row cap (same count on every DP rank);
    concatenating per-group outputs restores the batch order. See :mod:`async_rl.engine.microbatch`."""
    return plan.split(batch)


def _select(batch: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v[rows] for k, v in batch.items() if torch.is_tensor(v) and v.dim() > 0}


class EngineCheckpoints:
    """The checkpoint calls of an in-process role, the same as a worker group adapter's
    (:class:`~async_rl.workers.remote.RemoteRole`), so the learner saves and loads either kind alike
    (driver/roles.py). Needs ``self.engine``."""

    saves_sharded = False  # the driver's checkpoint holds this role's full state unless told to shard it
    world_size = 1

    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optim"}``: full weights and optimizer state (CPU tensors)."""
        return {"model": self.engine.full_state_dict(), "optim": self.engine.optimizer_state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.engine.load_full_state_dict(state["model"])
        if state.get("optim") is not None:
            self.engine.load_optimizer_state_dict(state["optim"])

    def save_sharded(self, directory) -> dict[str, Any]:
        """This process's shard of model + AdamW state (one rank here; torch.distributed.checkpoint)."""
        return self.engine.save_sharded(directory)

    def load_sharded(self, directory) -> dict[str, Any]:
        return self.engine.load_sharded(directory)


class ActorRole(EngineCheckpoints):
    """The policy: log-probs, entropy, one update with a verl-registered policy loss, weight export."""

    # the learner's calls, also on a worker group (workers/role_calls.py)
    REMOTE_CALLS = {
        "log_probs": RemoteCall(),
        "update": RemoteCall(required=MODEL_INPUT_KEYS + ("response_mask", "behaviour_log_probs",
                                                          f"{ARG_PREFIX}advantages"),
                             # the mismatch metrics come from all-reduced sums: already global too
                             trains=True, global_metrics=("actor/grad_norm", *MISMATCH_METRIC_KEYS),
                             zero_keys=("response_mask", f"{ARG_PREFIX}advantages")),
    }

    def __init__(
        self,
        model_or_path,
        optim: OptimizerConfig,
        temperature: float = 1.0,
        banned_token_ids: Sequence[int] = (),
        micro_batch_size: Optional[int] = None,
        precision: str = "fp32",
        max_tokens_per_micro_batch: Optional[int] = None,
        activation_checkpointing: bool = False,
        logits_chunk_tokens: Optional[int] = DEFAULT_LOGITS_CHUNK_TOKENS,
    ):
        model = load_causal_lm(model_or_path) if isinstance(model_or_path, (str, bytes)) or hasattr(
            model_or_path, "__fspath__") else model_or_path
        # precision / activation checkpointing / token budget / LM-head chunks: docs/engine.md §7
        self.engine = FSDPEngine(model, optim, precision=precision, activation_checkpointing=activation_checkpointing)
        self.temperature = temperature
        self.banned_token_ids = tuple(banned_token_ids)
        self.micro_batch_size = micro_batch_size
        self.micro_batching = MicroBatchPlan(max_tokens=max_tokens_per_micro_batch, max_rows=micro_batch_size)
        self.logits_chunk_tokens = logits_chunk_tokens

    @torch.no_grad()
    def log_probs(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``(bs, T)`` log π_θ of the response tokens (same rule as the rollout's behaviour log-prob)."""
        self.engine.eval_mode()
        out = []
        for rows in _micro_batches(batch, self.micro_batching):
            ids, attn, T = model_inputs(_select(batch, rows))
            lp, _ = response_token_logprobs(self.engine.module, ids.to(self.engine.device),
                                            attn.to(self.engine.device), T, self.temperature,
                                            self.banned_token_ids, chunk_tokens=self.logits_chunk_tokens)
            out.append(lp.cpu())
        return torch.cat(out)

    def update(
        self,
        batch: dict[str, torch.Tensor],
        advantages: torch.Tensor,
        loss_mode: str,
        clip_low: float = CLIP_LOW,
        clip_high: float = CLIP_HIGH,
        dis_low: float = DIS_LOW,
        dis_high: float = DIS_HIGH,
        loss_agg_mode: str = "seq-mean-token-mean",
    ) -> dict[str, float]:
        """One optimizer step on the batch with verl's registered policy loss ``loss_mode``.

        The ratio is taken against the stored behaviour log-probs (verl's bypass mode), which is what
        in-flight asynchronous training needs: tokens of one trajectory may come from several versions.
        ``loss_agg_mode="seq-mean-token-mean"`` is Eq. 1 (each trajectory's token mean counts once);
        ``"token-mean"`` is the ablation.
        """
        from verl.trainer.ppo.core_algos import get_policy_loss_fn

        if loss_mode not in POLICY_LOSSES:
            raise ValueError(f"unknown policy loss {loss_mode!r}; valid: {', '.join(POLICY_LOSSES)}")
        loss_fn = get_policy_loss_fn(loss_mode)
        # clip_ratio_c (dual clip) is read only by verl's ``vanilla`` loss, the ablation; ppo_clip (Eq. 1), dis and
        # dis_clip have no dual clip. verl's normalisers set to 1 make every registered loss return its local sum (of trajectory token
        # means, or of tokens); the engine divides by the count summed over all ranks, once per step, so
        # micro-batches and data-parallel shards add up to the one-batch loss exactly.
        config = OmegaConf.create({
            "clip_ratio": clip_low, "clip_ratio_low": clip_low, "clip_ratio_high": clip_high, "clip_ratio_c": 3.0,
            "policy_loss": {"rollout_correction": {"rollout_is_threshold": f"{dis_low}_{dis_high}"}},
            "global_batch_info": {"batch_num_tokens": 1, "global_batch_size": 1, "dp_size": 1},
        })
        self.engine.train_mode()
        denominator = self.engine.global_denominator(loss_normaliser_count(batch["response_mask"], loss_agg_mode))
        totals: dict[str, float] = {}
        loss_total = 0.0
        gap: dict[str, torch.Tensor] = {}
        for rows in _micro_batches(batch, self.micro_batching):
            mb = _select(batch, rows)
            ids, attn, T = model_inputs(mb)
            log_prob, _ = response_token_logprobs(self.engine.module, ids.to(self.engine.device),
                                                  attn.to(self.engine.device), T, self.temperature,
                                                  self.banned_token_ids, chunk_tokens=self.logits_chunk_tokens)
            device = log_prob.device
            if "current_version_mask" in mb:  # engine-vs-trainer gap before this step's update (docs/metrics.md)
                for key, value in mismatch_sums(mb["behaviour_log_probs"], log_prob.detach().cpu(),
                                                mb["response_mask"], mb["current_version_mask"],
                                                dis_low, dis_high).items():
                    gap[key] = gap.get(key, 0.0) + value
            loss_sum, metrics = loss_fn(
                old_log_prob=mb["behaviour_log_probs"].to(device), log_prob=log_prob,
                advantages=advantages[rows].to(device), response_mask=mb["response_mask"].to(device),
                loss_agg_mode=loss_agg_mode, config=config, rollout_is_weights=None,
            )
            loss_total += float(self.engine.backward(loss_sum, denominator))
            weight = float(loss_normaliser_count(mb["response_mask"], loss_agg_mode)) / max(denominator.value, 1.0)
            for key, value in metrics.items():
                totals[key] = totals.get(key, 0.0) + weight * float(value)
        grad_norm = self.engine.step()
        if gap:
            totals.update(mismatch_metrics({k: float(self.engine.global_denominator(v).value) for k, v in gap.items()}))
        return {"actor/pg_loss": loss_total, "actor/grad_norm": grad_norm, **totals}

    def export_weights(self) -> dict[str, torch.Tensor]:
        """Full CPU state dict for the rollout engine."""
        return self.engine.full_state_dict()


class CriticRole(EngineCheckpoints):
    """The separate critic: policy backbone + value head, attention frozen, its own optimizer and lr."""

    # the learner's calls, also on a worker group (workers/role_calls.py); the ranking loss is already global
    REMOTE_CALLS = {
        "values": RemoteCall(),
        "update": RemoteCall(required=MODEL_INPUT_KEYS + (f"{ARG_PREFIX}targets", f"{ARG_PREFIX}mask",
                                                          f"{ARG_PREFIX}old_values"),
                             trains=True, global_metrics=("critic/grad_norm", "li2sao/rank_loss"),
                             zero_keys=("response_mask", f"{ARG_PREFIX}mask")),
    }

    def __init__(
        self,
        model_or_path,
        optim: OptimizerConfig,
        freeze_attention: bool = True,
        micro_batch_size: Optional[int] = None,
        precision: str = "fp32",
        max_tokens_per_micro_batch: Optional[int] = None,
        activation_checkpointing: bool = False,
    ):
        critic = CriticModel.from_pretrained_policy(model_or_path, freeze_attention=freeze_attention)
        self.engine = FSDPEngine(critic, optim, precision=precision, activation_checkpointing=activation_checkpointing)
        self.micro_batch_size = micro_batch_size
        self.micro_batching = MicroBatchPlan(max_tokens=max_tokens_per_micro_batch, max_rows=micro_batch_size)

    def _values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        ids, attn, T = model_inputs(batch)
        values = self.engine.module(ids.to(self.engine.device), attn.to(self.engine.device))
        # the value of the state before response token j is read where token j is predicted
        return values[:, -T - 1:-1].float()

    @torch.no_grad()
    def values(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``(bs, T)`` V(s_t) at every response position (0 off real response tokens)."""
        self.engine.eval_mode()
        out = [self._values(_select(batch, rows)).cpu()
               for rows in _micro_batches(batch, self.micro_batching)]
        return torch.cat(out) * batch["response_attention"]

    def _ranking_gradient(self, batch, plan, ranking) -> tuple[torch.Tensor, float]:
        """``(g (bs,), L_rank)`` with ``g = ∂L_rank/∂V(s_{i,T_i})`` for this rank's rows at the current weights,
        where ``L_rank`` is Eq. 11 over the **global** batch: every mixed pair of every rank, ``1/|P|``.

        The ranking loss couples pairs of a group, which a token budget may put in different micro-batches
        and the data-parallel dispatch in different ranks. Its gradient w.r.t. the weights is
        ``Σ_i g_i ∂V_i/∂φ`` and ``g`` depends only on the terminal values, so one no-grad pass gives the local
        terminal values, an all-gather gives everyone's (with scores and group ids), and each micro-batch then
        back-propagates ``Σ_{i in mb} g_i V_i``. The engine sums gradients over ranks, so the result is the
        one-batch, one-rank gradient exactly, for one extra forward pass."""
        with torch.no_grad():
            terminal = torch.cat([
                values_at_last_model_token(self._values(_select(batch, rows)).cpu(),
                                           batch["response_mask"][rows])
                for rows in plan])
        order = torch.cat(list(plan))
        terminal_by_row = torch.empty_like(terminal)
        terminal_by_row[order] = terminal
        local = (terminal_by_row.tolist(), ranking["scores"].cpu().tolist(), list(ranking["group_ids"]))
        shards = dist.all_gather_objects(local)
        start = sum(len(s[0]) for s in shards[:dist.get_rank()])
        leaf = torch.tensor([v for s in shards for v in s[0]], dtype=terminal.dtype).requires_grad_(True)
        scores = torch.tensor([r for s in shards for r in s[1]], dtype=ranking["scores"].dtype)
        group_ids = [g for s in shards for g in s[2]]
        rank, _ = terminal_ranking_loss(leaf, scores, group_ids, ranking["margin"])
        (grad,) = torch.autograd.grad(rank, leaf)
        return grad.detach()[start:start + len(local[0])], float(rank.detach())

    def update(
        self,
        batch: dict[str, torch.Tensor],
        targets: torch.Tensor,
        mask: torch.Tensor,
        old_values: torch.Tensor,
        clip_eps: Optional[float] = 0.2,
        ranking: Optional[dict[str, Any]] = None,
    ) -> dict[str, float]:
        """One optimizer step of the value loss, plus ``α L_rank`` (Eq. 11) when
        ``ranking = {"scores", "group_ids", "margin", "coef"}`` is given (Li2SAO bootstrap). Under data
        parallelism ``L_rank`` is over the global batch's pairs (see :meth:`_ranking_gradient`) and
        ``li2sao/rank_loss`` is that global value on every rank.

        ``clip_eps=ε_v`` gives the clipped loss of Eq. 10 around ``old_values`` (the bootstrap's residual
        loss); ``clip_eps=None`` gives Eq. 5's plain squared error (absolute returns: LiSAO, PPO, Li2SAO
        after the switch)."""
        self.engine.train_mode()
        value_den = self.engine.global_denominator(mask.sum())
        one = GlobalDenominator(value=1.0, world_size=self.engine.world_size)
        value_loss_total = rank_total = 0.0
        clipfrac = 0.0
        plan = _micro_batches(batch, self.micro_batching)
        rank_grad = None
        if ranking is not None and (len(plan) > 1 or self.engine.world_size > 1):
            rank_grad, rank_total = self._ranking_gradient(batch, plan, ranking)
        for rows in plan:
            mb = _select(batch, rows)
            values = self._values(mb)
            device = values.device
            if clip_eps is None:
                vsum, m = squared_value_loss(values, targets[rows].to(device), mask[rows].to(device),
                                             loss_normaliser=1.0)
            else:
                vsum, m = clipped_value_loss(values, old_values[rows].to(device), targets[rows].to(device),
                                             mask[rows].to(device), clip_eps, loss_normaliser=1.0)
            loss = vsum / max(value_den.value, 1.0)
            value_loss_total += float(loss.detach())
            clipfrac += m["critic/vf_clipfrac"] * float(mask[rows].sum()) / max(value_den.value, 1.0)
            if rank_grad is not None:
                # pairs cross micro-batches: add Σ_i g_i V_i, whose gradient is exactly L_rank's (see below)
                terminal = values_at_last_model_token(values, mb["response_mask"].to(device))
                loss = loss + ranking["coef"] * (rank_grad[rows].to(device) * terminal).sum()
            elif ranking is not None:
                rank, _ = terminal_ranking_loss(values_at_last_model_token(values, mb["response_mask"].to(device)),
                                                ranking["scores"].to(device), ranking["group_ids"],
                                                ranking["margin"])
                rank_total += float(rank.detach())
                loss = loss + ranking["coef"] * rank
            self.engine.backward(loss, one)
        grad_norm = self.engine.step()
        metrics = {"critic/value_loss": value_loss_total, "critic/grad_norm": grad_norm,
                   "critic/vf_clipfrac": clipfrac}
        if ranking is not None:
            metrics["li2sao/rank_loss"] = rank_total
        return metrics
