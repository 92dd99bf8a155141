"""The clipped policy objective of Eq. 1 and its aggregation (spec §2-§4; li2sao paper Eq. 1, App. A.5).

    J(θ) = E_τ [ (1 / Σ_t m_t) Σ_t m_t ℓ_t(θ) ],   ℓ_t = min(ρ_t A_t, clip(ρ_t, 1-ε_low, 1+ε_high) A_t)

The expectation is over *trajectories*: each trajectory's token mean counts once, whatever its length
(``"seq-mean-token-mean"``, verl's name for it). A single token mean over the whole batch
(``"token-mean"``) weights long trajectories more; it is kept as a named ablation, off by default.
Eq. 1 has no dual clip (verl's ``vanilla`` loss adds one with ``clip_ratio_c = 3``), so GRPO uses
:func:`clipped_policy_loss` (registered in verl as ``ppo_clip``).

Losses return ``(loss, metrics)`` like verl's; ``loss_normaliser`` replaces the local count of the chosen
mode (trajectories or tokens) so data-parallel ranks and micro-batches can divide by a global count.
"""

from __future__ import annotations

import torch

from async_rl.algos._util import loss_denominator, masked_mean
# DAPO's clip ε_low, ε_high (spec §2) and the loss aggregations, written once in async_rl.config
from async_rl.config import CLIP_HIGH, CLIP_LOW, LOSS_AGG_MODES  # noqa: F401  (public names here too)

# exp(±20) bounds the ratio like verl does, so a huge log-ratio cannot overflow
_LOG_RATIO_BOUND = 20.0


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    loss_agg_mode: str = "seq-mean-token-mean",
    loss_normaliser: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """Reduce a token-loss matrix to the scalar of Eq. 1.

    Args:
        loss_mat: ``(bs, T)`` per-token loss.
        mask: ``(bs, T)``, 1 on model tokens (``m_t``).
        loss_agg_mode: ``"seq-mean-token-mean"`` (Eq. 1: mean over trajectories of each one's token mean;
            trajectories without a model token are left out) or ``"token-mean"`` (ablation).
        loss_normaliser: divide the local sum by this instead of the local count (number of trajectories
            with a model token, or number of model tokens): pass the count summed over all ranks.

    Returns:
        scalar loss. ``Σ_i (Σ_t m l / Σ_t m) / N_traj`` or ``Σ m l / Σ m``.
    """
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid choices: {', '.join(LOSS_AGG_MODES)}")
    m = mask.to(loss_mat.dtype)
    if loss_agg_mode == "token-mean":
        numerator = (loss_mat * m).sum()
        count = m.sum()
    else:
        tokens = m.sum(dim=-1)  # (bs,)
        numerator = ((loss_mat * m).sum(dim=-1) / tokens.clamp_min(1.0)).sum()
        count = (tokens > 0).to(loss_mat.dtype).sum()
    return numerator / loss_denominator(count, loss_normaliser)


def loss_normaliser_count(mask: torch.Tensor, loss_agg_mode: str = "seq-mean-token-mean") -> torch.Tensor:
    """The local count :func:`aggregate_loss` divides by: trajectories with a model token, or model tokens.
    Sum it over ranks to get the global ``loss_normaliser``. ``(bs, T) -> ()``."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; valid choices: {', '.join(LOSS_AGG_MODES)}")
    m = mask.to(torch.float32)
    if loss_agg_mode == "token-mean":
        return m.sum()
    return (m.sum(dim=-1) > 0).to(torch.float32).sum()


def clipped_policy_loss(
    log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_low: float = CLIP_LOW,
    clip_high: float = CLIP_HIGH,
    loss_agg_mode: str = "seq-mean-token-mean",
    loss_normaliser: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Eq. 1 with DAPO's asymmetric clip and no dual clip: ``-mean_τ token_mean min(ρA, clip(ρ)A)``.

    Args:
        log_prob: ``(bs, T)`` log π_θ(a_t|s_t), with grad.
        behaviour_log_prob: ``(bs, T)`` log-prob of the policy that sampled each token (ρ's denominator).
        advantages: ``(bs, T)``.
        response_mask: ``(bs, T)``, 1 on model tokens.
        clip_low, clip_high: ε_low, ε_high (DAPO: 0.2, 0.28; spec §2).
        loss_agg_mode, loss_normaliser: see :func:`aggregate_loss`.

    Returns:
        ``(loss, metrics)`` with ``actor/pg_clipfrac`` and ``actor/ppo_kl``.
    """
    if clip_low < 0 or clip_high < 0 or clip_low >= 1:
        raise ValueError(f"clip ratios must satisfy 0 <= clip_low < 1 and clip_high >= 0, got ({clip_low}, {clip_high})")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = (log_prob - behaviour_log_prob).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    pg = -advantages * ratio
    pg_clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss_mat = torch.maximum(pg, pg_clipped)
    loss = aggregate_loss(loss_mat, mask, loss_agg_mode, loss_normaliser)
    metrics = {
        "actor/pg_clipfrac": masked_mean((pg_clipped > pg).to(log_prob.dtype), mask).item(),
        "actor/ppo_kl": masked_mean(-log_ratio.detach(), mask).item(),
    }
    return loss, metrics


def squared_value_loss(
    values: torch.Tensor,
    targets: torch.Tensor,
    mask: torch.Tensor,
    loss_normaliser: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Eq. 5: ``L_V = Σ m (V - Ĝ)² / Σ m`` -- the critic fitting absolute returns (LiSAO, PPO, and Li2SAO
    after the switch; spec §3-§4). No value clipping: the clipped Eq. 10 is the bootstrap's residual loss.

    Args:
        values: ``(bs, T)`` current critic values (with grad).
        targets: ``(bs, T)`` returns Ĝ.
        mask: ``(bs, T)``, 1 on model tokens.
        loss_normaliser: replaces ``Σ m`` (the global token count for data parallelism).

    Returns:
        ``(loss, metrics)``; ``critic/vf_clipfrac`` is 0 (nothing is clipped).
    """
    m = mask.to(values.dtype)
    loss = (((values - targets) ** 2) * m).sum() / loss_denominator(m.sum(), loss_normaliser)
    return loss, {"critic/vf_clipfrac": 0.0}
