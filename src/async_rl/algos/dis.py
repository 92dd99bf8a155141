"""DIS: direct double-sided importance sampling (spec §3; li2sao paper Eq. 8-9).

    ρ_t = π_θ(a_t|s_t) / π_{r,v_t}(a_t|s_t)          (behaviour log-prob stored at sampling time)
    loss_t = -f(ρ_t) A_t,   f(x) = x if 1-ε_l < x < 1+ε_h else 0

Tokens outside the interval contribute neither loss nor gradient. Paper interval: (0.7, 6.0).
The token mask is the same rule as verl's rollout-correction "IcePop" token weights with threshold
``"0.7_6.0"`` (``rollout_corr_helper.compute_rollout_correction_weights(rollout_is="token")``); the test
suite cross-checks the two on the same inputs.

For Li2SAO's bootstrap phase (spec §4: "clipped objective with DIS correction") pass ``clip_low`` and
``clip_high``: the loss becomes the clipped PPO term on ρ, still zeroed outside the DIS interval.
"""

from __future__ import annotations

import torch

from async_rl.algos._util import masked_mean
from async_rl.algos.policy import aggregate_loss
from async_rl.config import DIS_HIGH, DIS_LOW  # the DIS interval's defaults (spec §3), written once there

# exp(±20) bounds the ratio like verl does, so a huge log-ratio cannot overflow before masking
_LOG_RATIO_BOUND = 20.0


def dis_mask(log_ratio: torch.Tensor, low: float = DIS_LOW, high: float = DIS_HIGH) -> torch.Tensor:
    """1 where ``low < exp(log_ratio) < high``; ``(bs, T)`` float."""
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND))
    return ((ratio > low) & (ratio < high)).to(log_ratio.dtype)


def dis_policy_loss(
    log_prob: torch.Tensor,
    behaviour_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    low: float = DIS_LOW,
    high: float = DIS_HIGH,
    clip_low: float | None = None,
    clip_high: float | None = None,
    loss_agg_mode: str = "seq-mean-token-mean",
    loss_normaliser: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """DIS policy loss aggregated as Eq. 1: the mean over trajectories of each trajectory's token mean
    (masked tokens count in their trajectory's length with a zero term).

    Args:
        log_prob: ``(bs, response_length)`` log π_θ(a_t|s_t), with grad.
        behaviour_log_prob: ``(bs, response_length)`` stored log π_{r,v_t}(a_t|s_t) of the version that
            sampled each token.
        advantages: ``(bs, response_length)``.
        response_mask: ``(bs, response_length)``, 1 on model tokens.
        low, high: the DIS interval (1-ε_l, 1+ε_h); spec: (0.7, 6.0).
        clip_low, clip_high: optional PPO clip ε's (e.g. DAPO 0.2 / 0.28) for Li2SAO's bootstrap.
        loss_agg_mode: ``"seq-mean-token-mean"`` (Eq. 1, default) or ``"token-mean"`` (ablation); see
            :func:`async_rl.algos.policy.aggregate_loss`.
        loss_normaliser: divide the local sum by this instead of the local count of the mode (trajectories
            or tokens): pass the count summed over ranks for data-parallel training.

    Returns:
        ``(loss, metrics)``; metrics ``actor/dis_masked_frac``, ``actor/ppo_kl`` (w.r.t. behaviour),
        ``actor/dis_kept_kl`` (k3 estimate ``ρ - 1 - log ρ`` over the tokens inside the band: the drift on
        the tokens that carry gradient), ``actor/pg_clipfrac`` (0 without clipping).
    """
    if low >= 1.0 or high <= 1.0:
        raise ValueError(f"DIS interval must contain 1: got ({low}, {high}); spec §3 uses (0.7, 6.0)")
    mask = response_mask.to(log_prob.dtype)
    log_ratio = (log_prob - behaviour_log_prob).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    keep = dis_mask(log_ratio.detach(), low, high) * mask
    pg = -advantages * ratio
    clipfrac = torch.zeros((), dtype=log_prob.dtype)
    if clip_low is not None or clip_high is not None:
        lo = 1.0 - (clip_low if clip_low is not None else clip_high)
        hi = 1.0 + (clip_high if clip_high is not None else clip_low)
        pg_clipped = -advantages * ratio.clamp(lo, hi)
        clipfrac = masked_mean((pg_clipped > pg).to(log_prob.dtype), keep)
        pg = torch.maximum(pg, pg_clipped)
    # multiplying by a 0/1 mask (not where) keeps the graph, so masked tokens get exactly zero gradient
    loss = aggregate_loss(pg * keep, mask, loss_agg_mode, loss_normaliser)
    metrics = {
        "actor/dis_masked_frac": (masked_mean(1.0 - keep, mask)).item(),
        "actor/ppo_kl": masked_mean(-log_ratio.detach(), mask).item(),
        # ppo_kl counts the masked tokens too; a few whose probability collapsed can dominate it although the
        # band already gives them zero weight (docs/algorithms.md, "Stability")
        "actor/dis_kept_kl": masked_mean(ratio.detach() - 1.0 - log_ratio.detach(), keep).item(),
        "actor/pg_clipfrac": float(clipfrac),
    }
    return loss, metrics
