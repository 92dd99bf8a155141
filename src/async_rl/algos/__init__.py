"""Pure tensor functions for every equation of the spec (stated in docs/algorithms.md; "spec §N" in docstrings).

No Ray, model, vLLM or Hydra imports here: workers and the driver call these, each algorithm's estimator is
registered in verl's registry by :mod:`async_rl.verl_plugin` and called through it, tests call them directly.
"""

from async_rl.algos.dis import dis_mask, dis_policy_loss
from async_rl.algos.gae import (
    discounted_reverse_cumsum,
    length_adaptive_lambda,
    masked_whiten,
    sao_gae,
    skip_observation_gae,
)
from async_rl.algos.grpo import broadcast_to_tokens, group_statistics, grpo_group_advantage
from async_rl.algos.li2sao import (
    READINESS_FIELDS,
    ReadinessGate,
    bootstrap_returns,
    clipped_value_loss,
    divergence_mask,
    li2sao_advantage,
    li2sao_critic_loss,
    readiness_from_statistics,
    readiness_statistics,
    residual_critic_targets,
    terminal_ranking_loss,
    values_at_last_model_token,
)
from async_rl.algos.policy import (
    LOSS_AGG_MODES,
    aggregate_loss,
    clipped_policy_loss,
    loss_normaliser_count,
    squared_value_loss,
)
from async_rl.algos.metrics import explained_variance, pass_at_k, policy_lag_stats
from async_rl.algos.sapo import (
    broadcast_turns_to_tokens,
    normalise_turn_advantages,
    normalised_readout,
    num_turns_of,
    ppo_clip_token_loss,
    restricted_entropy,
    restricted_log_softmax,
    restricted_token_logprobs,
    sapo_targets,
    sapo_total_loss,
    sapo_turn_estimator,
    turn_boundaries,
    turn_gae,
    turn_value_loss,
    two_logit_value,
    sapo_update_targets,
)

__all__ = [name for name in dir() if not name.startswith("_")]
