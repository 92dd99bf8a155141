"""Skip-observation GAE with a length-adaptive λ (spec §3; li2sao paper Eq. 4-7).

With ``u_1 < ... < u_M`` the model-token positions of a trajectory,

    δ_{u_j} = r_{u_j} + γ V(s_{u_{j+1}}) - V(s_{u_j}),      δ_{u_M} = r_{u_M} - V(s_{u_M})
    A_{u_j} = δ_{u_j} + γ λ A_{u_{j+1}}

Observation tokens (``response_mask == 0``) carry no value transition and no advantage: the recursion
jumps over them. Entry points: :func:`sao_gae` (LiSAO's estimator), :func:`skip_observation_gae`,
:func:`length_adaptive_lambda`, :func:`masked_whiten`, :func:`discounted_reverse_cumsum` (the blocked scan).

Details: docs/algorithms.md (LiSAO (spec §3): the table and "How the GAE is computed").
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from async_rl.algos.estimate import AdvantageEstimate, config_value
from async_rl.algos.metrics import critic_explained_variance


def length_adaptive_lambda(response_mask: torch.Tensor, alpha: float = 1.5) -> torch.Tensor:
    """``λ = clamp(1 - 1/(α L), 0, 1)`` with ``L`` the number of model tokens (spec §3).

    Args:
        response_mask: ``(bs, response_length)``, 1 on model tokens.
        alpha: α (paper: 1.5).

    Returns:
        ``(bs,)`` float32 λ per trajectory (0 for an empty trajectory).
    """
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0 (spec §3 uses 1.5), got {alpha}")
    length = response_mask.to(torch.float32).sum(dim=-1)
    lam = 1.0 - 1.0 / (alpha * length.clamp_min(1e-12))
    return lam.clamp(0.0, 1.0)


def _decay_powers(decay: torch.Tensor, n: int, scale: int = 1) -> torch.Tensor:
    """``w[r, j, k] = decay_r^(scale (k - j))`` for ``k >= j``, else 0; ``(rows, n, n)`` for ``decay`` of
    shape ``(rows,)``. pow(0, 0) = 1 keeps a zero decay exact."""
    steps = torch.arange(n, device=decay.device, dtype=decay.dtype)
    offset = steps.view(1, n) - steps.view(n, 1)  # offset[j, k] = k - j
    powers = torch.pow(decay.view(-1, 1, 1), scale * offset.clamp_min(0))
    return powers.masked_fill_(offset < 0, 0.0)


def discounted_reverse_cumsum(x: torch.Tensor, decay: torch.Tensor | float, block: int = 32) -> torch.Tensor:
    """``y_j = x_j + decay * y_{j+1}`` along the last axis, with ``y`` past the end = 0.

    No Python loop over steps: inside each block of ``block`` steps, ``local = W x`` with
    ``W[j, k] = decay^(k-j)`` (one matrix product); the first entries of the blocks obey the same
    recursion with decay^block, solved by this function on the ``M/block`` of them (log_block(M) levels);
    each block then adds ``decay^(block-j)`` times the first entry of the next block. One decay for every
    row (a float, or a tensor of equal entries) shares one ``W`` (a plain matrix product); different decays
    build one ``W`` per row.

    Args:
        x: ``(bs, M)``.
        decay: a float, or ``(bs,)`` the per-row discount (γλ).
        block: steps solved at once by a ``(block, block)`` matrix product.

    Returns:
        ``(bs, M)`` in the dtype of ``x``.
    """
    if block < 2:
        raise ValueError(f"block must be >= 2 (the scan recurses on M/block block heads), got {block}")
    bs, M = x.shape
    if M == 0 or bs == 0:
        return x.clone()
    decay = torch.as_tensor(decay, dtype=x.dtype, device=x.device).reshape(-1)
    if decay.numel() not in (1, bs):
        raise ValueError(f"decay must be a float or have one entry per row ({bs}), got {decay.numel()} entries")
    if decay.numel() > 1 and bool((decay == decay[0]).all()):
        decay = decay[:1]
    rows = decay.numel()  # 1: one W for all rows
    b = min(block, M)
    n_blocks = -(-M // b)
    padded = torch.nn.functional.pad(x, (0, n_blocks * b - M)).reshape(bs, n_blocks, b)
    weights = _decay_powers(decay, b).transpose(1, 2)  # (rows, b, b), weights[r, k, j] = decay^(k-j)
    local = torch.matmul(padded, weights[0] if rows == 1 else weights)  # (bs, n_blocks, b)
    if n_blocks == 1:
        return local.reshape(bs, b)[:, :M]
    # heads[n] = out[n, 0] = local[n, 0] + decay^b * heads[n + 1]: the same scan, M/b long (recursively)
    heads = discounted_reverse_cumsum(local[:, :, 0], torch.pow(decay, b), block=block)  # (bs, n_blocks)
    next_head = torch.nn.functional.pad(heads[:, 1:], (0, 1))  # 0 after the last block
    steps = torch.arange(b, device=x.device, dtype=x.dtype)
    carry_scale = torch.pow(decay.view(rows, 1), (b - steps).view(1, b))  # decay^(b-j), (rows, b)
    out = local.addcmul_(next_head.unsqueeze(-1), carry_scale.unsqueeze(1))
    return out.reshape(bs, n_blocks * b)[:, :M]


def _compact_index(response_mask: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Column of each model token in the left-compacted layout (its rank among the row's model tokens);
    every other position points at a spare column ``M`` (``M`` = the longest row's model-token count)."""
    is_model = response_mask.bool()
    rank = is_model.cumsum(dim=-1, dtype=torch.int64).sub_(1)
    M = int(rank[:, -1].max().item()) + 1 if rank.numel() else 0
    return rank.masked_fill_(~is_model, M), M


def masked_whiten(
    x: torch.Tensor, mask: torch.Tensor, process_group=None, eps: float = 1e-8
) -> torch.Tensor:
    """``(x - mean) / sqrt(var + eps)`` over the masked entries of the whole data-parallel group.

    Count, sum and sum of squares are all-reduced when ``process_group`` is given (or the default group
    is initialised and ``process_group="world"``), so every rank whitens with the same global statistics.
    The variance is unbiased (``n - 1``), as verl's ``masked_whiten``. Masked-out entries return 0.
    """
    m = mask.to(x.dtype)
    xm = x * m
    stats = torch.stack([m.sum(), xm.sum(), (xm * x).sum()])
    if process_group is not None:
        group = None if process_group == "world" else process_group
        dist.all_reduce(stats, op=dist.ReduceOp.SUM, group=group)
    count, total, total_sq = stats
    mean = total / count.clamp_min(1.0)
    var = (total_sq - count * mean * mean) / (count - 1).clamp_min(1.0)
    return torch.addcmul(xm, m, mean, value=-1.0).mul_(torch.rsqrt(var.clamp_min(0.0) + eps))


def skip_observation_gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    lam: torch.Tensor | float,
    gamma: float = 1.0,
    critic_lam: float = 1.0,
    whiten: bool = False,
    process_group=None,
    block: int = 32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Skip-observation GAE (spec §3, Eq. 6-7) for the policy and λ-returns for the critic.

    Args:
        token_level_rewards: ``(bs, response_length)``, reward on model tokens (terminal: last one).
        values: ``(bs, response_length)``, ``V(s_t)`` read at each response position.
        response_mask: ``(bs, response_length)``, 1 on model tokens, 0 on observation and padding.
        lam: λ for the policy advantage: a float or ``(bs,)`` (one per trajectory).
        gamma: γ (spec: 1).
        critic_lam: λ of the critic's return target (spec: 1).
        whiten: whiten advantages over model tokens (across ``process_group`` if given).
        process_group: torch.distributed group for whitening statistics, or ``"world"``.
        block: block size of the scan.

    Returns:
        ``(advantages, returns)``, both ``(bs, response_length)`` and 0 off model tokens.
        ``returns = A^{critic_lam} + V`` is the critic target (``= R`` for γ = λ = 1 and terminal reward).
    """
    if not (token_level_rewards.shape == values.shape == response_mask.shape):
        raise ValueError(
            f"shape mismatch: rewards {tuple(token_level_rewards.shape)}, values {tuple(values.shape)}, "
            f"response_mask {tuple(response_mask.shape)}; all must be (bs, response_length)"
        )
    with torch.no_grad():
        dtype = torch.promote_types(values.dtype, torch.float32)
        bs = values.shape[0]
        target, M = _compact_index(response_mask)
        # compacted width: the spare column M included, rounded up to whole blocks (no padding in the scan)
        width = -(-(M + 1) // block) * block
        # compact: model tokens to the left of each row; everything else lands in the spare column M
        # (zeroed after), so δ = 0 and V = 0 from each row's end on, and V(after the last model token) = 0
        v = values.new_zeros(bs, width + 1, dtype=dtype).scatter_(1, target, values.to(dtype))
        r = values.new_zeros(bs, width, dtype=dtype).scatter_(1, target, token_level_rewards.to(dtype))
        v[:, M] = 0.0
        r[:, M] = 0.0
        v_now = v[:, :width]
        delta = torch.add(r, v[:, 1:], alpha=gamma).sub_(v_now)
        lam_t = torch.as_tensor(lam, dtype=dtype, device=values.device).reshape(-1)
        advantages = discounted_reverse_cumsum(delta, gamma * lam_t, block=block).gather(1, target)
        returns = discounted_reverse_cumsum(delta, gamma * critic_lam, block=block).add_(v_now).gather(1, target)
        if whiten:
            advantages = masked_whiten(advantages, response_mask, process_group=process_group)
    return advantages, returns


def sao_gae(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    alpha: float = 1.5,
    gamma: float = 1.0,
    whiten: bool = True,
    process_group=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LiSAO's estimator (spec §3): skip-observation GAE, per-trajectory λ = clamp(1 - 1/(αL), 0, 1),
    γ = 1, critic returns with λ = 1, advantages whitened across the data-parallel group.

    Args/Returns: as :func:`skip_observation_gae`; shapes ``(bs, response_length)``.
    """
    lam = length_adaptive_lambda(response_mask, alpha)
    return skip_observation_gae(
        token_level_rewards, values, response_mask, lam=lam, gamma=gamma, critic_lam=1.0,
        whiten=whiten, process_group=process_group,
    )


def sao_gae_estimator(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    values: Optional[torch.Tensor] = None,
    config=None,
    **unused,
) -> AdvantageEstimate:
    """Single-rollout skip-observation GAE (spec §3), registered in verl as ``sao_gae``: LiSAO, Li2SAO after
    the switch, and PPO with a fixed λ. The critic fits the absolute λ = 1 returns on every model token with
    plain squared error (Eq. 5; ``clip_absolute_value_loss`` clips it with ``value_clip``, an ablation).

    Args:
        token_level_rewards, response_mask, values: ``(bs, T)``; ``values`` (the critic's V_old) are required:
            stock verl's ``compute_advantage`` does not pass them, so call the registered function with them.
        config: ``gamma`` (1.0), ``gae_alpha`` or verl's ``sao_alpha`` (α = 1.5), ``whiten_advantages`` or
            verl's ``sao_whiten`` (True), ``gae_lambda`` (None = length-adaptive λ; a number = that fixed λ),
            ``clip_absolute_value_loss`` (False), ``value_clip`` (0.2).
    """
    if values is None:
        raise ValueError(
            "sao_gae needs critic values, but verl's compute_advantage does not pass them to registered "
            "estimators. Call it as get_adv_estimator_fn('sao_gae')(token_level_rewards=..., "
            "response_mask=..., values=data.batch['values'], config=...), as async_rl's driver does."
        )
    gamma = float(config_value(config, "gamma", 1.0))
    whiten = bool(config_value(config, "whiten_advantages", True, alias="sao_whiten"))
    fixed_lambda = config_value(config, "gae_lambda", None)
    if fixed_lambda is None:
        alpha = float(config_value(config, "gae_alpha", 1.5, alias="sao_alpha"))
        advantages, returns = sao_gae(token_level_rewards, values, response_mask, alpha=alpha, gamma=gamma,
                                      whiten=whiten)
    else:
        advantages, returns = skip_observation_gae(token_level_rewards, values, response_mask,
                                                   lam=float(fixed_lambda), gamma=gamma, whiten=whiten)
    clipped = bool(config_value(config, "clip_absolute_value_loss", False))
    return AdvantageEstimate(advantages, returns, critic_targets=returns, critic_mask=response_mask,
                             value_clip=float(config_value(config, "value_clip", 0.2)) if clipped else None,
                             metrics=critic_explained_variance(values, returns, response_mask, None))

