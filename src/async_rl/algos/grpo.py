"""GRPO group-relative outcome advantage (spec §2; li2sao paper Eq. 2).

The policy objective for GRPO is Eq. 1 with DAPO's asymmetric clip (``clip_ratio_low=0.2``,
``clip_ratio_high=0.28``): :func:`async_rl.algos.policy.clipped_policy_loss`, registered in verl as
``ppo_clip``. verl's own ``vanilla`` adds a dual clip that Eq. 1 does not have.
"""

from __future__ import annotations

import torch

from async_rl.algos._util import group_index
from async_rl.algos.estimate import AdvantageEstimate, config_value


def group_statistics(scores: torch.Tensor, group_ids) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-sample group mean, sample std (divide by ``n-1``) and group size.

    Args:
        scores: ``(bs,)`` outcome reward of each response.
        group_ids: ``(bs,)`` prompt-group id of each response (any hashable values).

    Returns:
        ``(mean, std, size)``, each ``(bs,)``, gathered back to the samples. A group of one has
        mean = its score, std = 0, size = 1.
    """
    scores = scores.to(torch.float32)
    dense = group_index(group_ids, device=scores.device)
    n_groups = int(dense.max().item()) + 1 if dense.numel() else 0
    size = torch.zeros(n_groups, device=scores.device).index_add_(0, dense, torch.ones_like(scores))
    total = torch.zeros(n_groups, device=scores.device).index_add_(0, dense, scores)
    mean = total / size
    centered_sq = (scores - mean[dense]) ** 2
    sq = torch.zeros(n_groups, device=scores.device).index_add_(0, dense, centered_sq)
    # sample variance (n-1); a singleton group has no spread
    std = torch.sqrt(sq / (size - 1).clamp_min(1.0))
    # "all rewards equal" is decided exactly: a float32 mean of equal fractional rewards can round, which
    # would leave a tiny nonzero std and make an all-equal group look mixed
    high = torch.full((n_groups,), float("-inf"), device=scores.device).scatter_reduce(0, dense, scores, "amax")
    low = torch.full((n_groups,), float("inf"), device=scores.device).scatter_reduce(0, dense, scores, "amin")
    std = torch.where(high == low, torch.zeros_like(std), std)
    mean = torch.where(high == low, high, mean)
    return mean[dense], std[dense], size[dense]


def grpo_group_advantage(
    scores: torch.Tensor,
    group_ids,
    epsilon: float = 1e-6,
    norm_by_std: bool = True,
) -> torch.Tensor:
    """``A_i = (R_i - mean_g R) / (std_g R + eps)`` with the sample std (spec §2).

    Equal rewards in a group give zero advantage. A singleton group gets advantage 0.

    Args:
        scores: ``(bs,)`` outcome rewards.
        group_ids: ``(bs,)`` group ids.
        epsilon: ε in the denominator.
        norm_by_std: divide by the std (GRPO); ``False`` gives Dr.GRPO's mean-centring only.

    Returns:
        ``(bs,)`` advantage per response.
    """
    mean, std, _ = group_statistics(scores, group_ids)
    centred = scores.to(torch.float32) - mean
    if not norm_by_std:
        return centred
    # an all-equal group has zero spread: its advantage is exactly 0 even with epsilon = 0
    return torch.where(std > 0, centred / (std + epsilon), torch.zeros_like(centred))


def broadcast_to_tokens(per_sample: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Write a per-response value on every model token: ``(bs,) -> (bs, response_length)``."""
    return per_sample.unsqueeze(-1) * response_mask.to(per_sample.dtype)


def grpo_group_estimator(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index=None,
    config=None,
    scores: torch.Tensor | None = None,
    **unused,
) -> AdvantageEstimate:
    """GRPO's estimator (spec §2), registered in verl as ``grpo_group``: :func:`grpo_group_advantage` on every
    model token; no critic (``returns`` = the advantages, as verl's own ``grpo`` does).

    Unlike verl's ``grpo``, a group of one gets advantage 0 and an all-equal group exactly 0.

    Args:
        token_level_rewards, response_mask: ``(bs, T)``.
        index: ``(bs,)`` prompt-group ids (verl's ``uid``).
        config: reads ``grpo_epsilon`` (1e-6).
        scores: ``(bs,)`` outcome rewards; default: the row sums of ``token_level_rewards``.
    """
    if index is None:
        raise ValueError("grpo_group needs `index` (verl's non_tensor_batch['uid']) to form prompt groups")
    scores = token_level_rewards.sum(dim=-1) if scores is None else scores
    epsilon = float(config_value(config, "grpo_epsilon", 1e-6))
    advantages = broadcast_to_tokens(grpo_group_advantage(scores, index, epsilon), response_mask)
    return AdvantageEstimate(advantages, advantages)

