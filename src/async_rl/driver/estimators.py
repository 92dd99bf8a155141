"""Advantage estimators of the trainer, registered by name, and which one each algorithm uses (spec §2-§5).

An estimator turns a collated batch and the critic's frozen values into advantages, the critic's targets
and mask, and its own metrics. The Learner looks both the plan and the estimator up here; the equations
themselves live in :mod:`async_rl.algos`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch

from async_rl.algos import (
    bootstrap_returns,
    broadcast_to_tokens,
    divergence_mask,
    grpo_group_advantage,
    residual_critic_targets,
    sao_gae,
    skip_observation_gae,
)
from async_rl.config import AlgorithmConfig
from async_rl.driver.batch import critic_explained_variance, readiness_metrics


@dataclass
class Estimate:
    """What an estimator hands the critic and actor updates; shapes ``(bs, T)`` unless noted."""

    advantages: torch.Tensor
    critic_targets: Optional[torch.Tensor] = None  # None: no critic update from this batch
    critic_mask: Optional[torch.Tensor] = None
    value_clip: Optional[float] = None  # clip of the critic loss around V_old; None = plain squared error
    ranking: Optional[dict] = None  # Li2SAO's ranking-loss inputs (Eq. 11)
    metrics: dict[str, float] = field(default_factory=dict)


Estimator = Callable[[dict, Optional[torch.Tensor], list, AlgorithmConfig], Estimate]
ESTIMATORS: dict[str, Estimator] = {}


def register_estimator(name: str) -> Callable[[Estimator], Estimator]:
    def add(fn: Estimator) -> Estimator:
        if name in ESTIMATORS:
            raise RuntimeError(f"estimator {name!r} is registered twice")
        ESTIMATORS[name] = fn
        return fn
    return add


def get_estimator(name: str) -> Estimator:
    if name not in ESTIMATORS:
        raise ValueError(f"no estimator {name!r}; registered: {', '.join(sorted(ESTIMATORS))}")
    return ESTIMATORS[name]


@register_estimator("grpo_group")
def grpo_group(batch: dict, old_values: Optional[torch.Tensor], group_ids: list, cfg: AlgorithmConfig) -> Estimate:
    """GRPO (spec §2): the group-normalised score on every token; no critic."""
    mask = batch["response_mask"]
    return Estimate(broadcast_to_tokens(grpo_group_advantage(batch["scores"], group_ids, cfg.grpo_epsilon), mask))


@register_estimator("li2sao_bootstrap")
def li2sao_bootstrap(batch: dict, old_values: Optional[torch.Tensor], group_ids: list,
                     cfg: AlgorithmConfig) -> Estimate:
    """Li2SAO's bootstrap (spec §4): group advantages for the actor; residual targets (λ = 1, Ĝ_t = γ^k R minus
    the group mean) under the divergence mask, the ranking loss and a clipped residual loss (Eq. 10) for
    the critic; readiness statistics for the gate."""
    mask, scores = batch["response_mask"], batch["scores"]
    advantages = broadcast_to_tokens(grpo_group_advantage(scores, group_ids, cfg.grpo_epsilon), mask)
    returns = bootstrap_returns(scores, mask, cfg.gamma)
    targets, keep = residual_critic_targets(returns, scores, group_ids, mask)
    critic_mask = divergence_mask(batch["responses"], mask, scores, group_ids,
                                  batch["response_attention"]) * keep.unsqueeze(1)
    metrics = readiness_metrics(old_values, scores, group_ids, mask)
    metrics.update(critic_explained_variance(old_values, targets, mask * keep.unsqueeze(1), critic_mask))
    ranking = {"scores": scores, "group_ids": group_ids, "margin": cfg.rank_margin, "coef": cfg.rank_coef}
    return Estimate(advantages, targets, critic_mask, cfg.value_clip, ranking, metrics)


@register_estimator("gae")
def single_rollout_gae(batch: dict, old_values: Optional[torch.Tensor], group_ids: list,
                       cfg: AlgorithmConfig) -> Estimate:
    """Skip-observation GAE (spec §3): length-adaptive λ (LiSAO, Li2SAO after the switch) or a fixed λ (PPO).
    The critic fits the absolute returns with plain squared error (Eq. 5; clipping is an ablation)."""
    rewards, mask = batch["token_level_rewards"], batch["response_mask"]
    if cfg.gae_lambda is None:
        advantages, returns = sao_gae(rewards, old_values, mask, alpha=cfg.gae_alpha, gamma=cfg.gamma,
                                      whiten=cfg.whiten_advantages)
    else:
        advantages, returns = skip_observation_gae(rewards, old_values, mask, lam=cfg.gae_lambda, gamma=cfg.gamma,
                                                   whiten=cfg.whiten_advantages)
    value_clip = cfg.value_clip if cfg.clip_absolute_value_loss else None
    return Estimate(advantages, returns, mask, value_clip, None,
                    critic_explained_variance(old_values, returns, mask, None))


@dataclass(frozen=True)
class AlgorithmPlan:
    """Which estimator and policy loss an algorithm trains with, before and after Li2SAO's switch."""

    grouped_estimator: str  # batches of prompt groups (group_size > 1)
    single_estimator: str  # batches of one rollout per prompt
    gated: bool = False  # a readiness gate decides one switch to single rollout (Li2SAO)
    bootstrap_loss: Optional[str] = None  # policy loss before the switch; None = algorithm.policy_loss
    single_loss: Optional[str] = None  # policy loss after it
    shared_backbone: bool = False  # SAPO: the actor computes its own turn targets (spec §5)


ALGORITHM_PLANS: dict[str, AlgorithmPlan] = {
    "grpo": AlgorithmPlan("grpo_group", "grpo_group"),
    "lisao": AlgorithmPlan("gae", "gae"),
    "ppo": AlgorithmPlan("gae", "gae"),
    "li2sao": AlgorithmPlan("li2sao_bootstrap", "gae", gated=True, bootstrap_loss="dis_clip", single_loss="dis"),
    "sapo": AlgorithmPlan("sapo_turn", "sapo_turn", shared_backbone=True),
}


def plan_for(name: str) -> AlgorithmPlan:
    if name not in ALGORITHM_PLANS:
        raise ValueError(f"algorithm.name={name!r} has no training plan; valid: {', '.join(ALGORITHM_PLANS)}")
    return ALGORITHM_PLANS[name]
