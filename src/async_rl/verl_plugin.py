"""Register our estimators and policy losses in verl's registries (:func:`register`).

Loaded by ``import async_rl`` and by verl itself through the ``verl.plugins`` entry point, so Ray workers
of stock verl see the names too; an entry verl had is never overwritten. Advantage estimators (the functions
live in :mod:`async_rl.algos`; our trainer calls them through verl's registry, by the names of
:data:`async_rl.config.ALGORITHM_PLANS`): ``grpo_group`` (GRPO, spec §2), ``sao_gae`` (LiSAO, PPO, Li2SAO after the switch,
spec §3), ``li2sao_group`` (Li2SAO, spec §4), ``sapo_turn`` (SAPO, spec §5). Policy losses: ``ppo_clip``
(Eq. 1, no dual clip), ``dis`` (spec §3), ``dis_clip`` (spec §4), ``sapo_ar`` (spec §5; verl's own ``sapo`` is
another algorithm). Rollout replica: ``hf``, loaded lazily. ``sao_gae`` and ``sapo_turn`` need critic values /
turn tensors that verl's ``compute_advantage`` never passes: our driver calls them with those.

Details: docs/algorithms.md (Registration in verl; "Critic values in verl").
"""

from __future__ import annotations

from typing import Any, Optional

from verl.trainer.ppo import core_algos

from async_rl.algos.dis import dis_policy_loss
from async_rl.algos.estimate import config_value
from async_rl.algos.gae import sao_gae_estimator
from async_rl.algos.grpo import grpo_group_estimator
from async_rl.algos.li2sao import li2sao_group_estimator
from async_rl.algos.policy import LOSS_AGG_MODES, clipped_policy_loss
from async_rl.algos.sapo import ppo_clip_token_loss, sapo_turn_estimator

ADV_ESTIMATOR_NAMES = ("grpo_group", "sao_gae", "li2sao_group", "sapo_turn")
POLICY_LOSS_NAMES = ("ppo_clip", "dis", "dis_clip", "sapo_ar")


# ----------------------------------------------------------------------------------------------------
# policy losses (verl signature: old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
# rollout_is_weights)
# ----------------------------------------------------------------------------------------------------
def _dis_bounds(config: Any) -> tuple[float, float]:
    """DIS interval from ``policy_loss.rollout_correction.rollout_is_threshold`` when it is a
    ``"low_high"`` string (verl's IcePop syntax), else the paper's (0.7, 6.0)."""
    policy_loss = config_value(config, "policy_loss", None)
    corr = config_value(policy_loss, "rollout_correction", None)
    spec = config_value(corr, "rollout_is_threshold", None)
    if isinstance(spec, str) and "_" in spec:
        low, high = (float(x) for x in spec.split("_", 1))
        return low, high
    return 0.7, 6.0


def _normaliser(config: Any, loss_agg_mode: str, name: str) -> Optional[float]:
    """verl's global normaliser for our losses: ``agg_loss`` divides by the global count and multiplies by
    ``dp_size`` (FSDP then averages gradients over ranks), i.e. it divides the local sum by count / dp_size."""
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"{name} supports loss_agg_mode in {LOSS_AGG_MODES}, got {loss_agg_mode!r}")
    batch_info = config_value(config, "global_batch_info", {}) or {}
    key = "batch_num_tokens" if loss_agg_mode == "token-mean" else "global_batch_size"
    if batch_info.get(key) is None:
        return None
    return batch_info[key] / batch_info.get("dp_size", 1)


def _clip_ratios(config: Any) -> tuple[float, float]:
    clip = float(config_value(config, "clip_ratio", 0.2))
    return float(config_value(config, "clip_ratio_low", clip)), float(config_value(config, "clip_ratio_high", clip))


def _no_second_is_weight(rollout_is_weights, name: str) -> None:
    if rollout_is_weights is not None:
        raise ValueError(
            f"{name} computes its own importance ratio against the behaviour log-probs (pass them as "
            "old_log_prob, i.e. verl's bypass mode); disable rollout_is so no second IS weight is applied"
        )


def _dis_common(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                rollout_is_weights, clipped: bool):
    name = "dis_clip" if clipped else "dis"
    _no_second_is_weight(rollout_is_weights, name)
    normaliser = _normaliser(config, loss_agg_mode, name)
    low, high = _dis_bounds(config)
    clip_low = clip_high = None
    if clipped:
        clip_low, clip_high = _clip_ratios(config)
    return dis_policy_loss(log_prob, old_log_prob, advantages, response_mask, low=low, high=high,
                           clip_low=clip_low, clip_high=clip_high, loss_agg_mode=loss_agg_mode,
                           loss_normaliser=normaliser)


def compute_policy_loss_ppo_clip(old_log_prob, log_prob, advantages, response_mask,
                                 loss_agg_mode="seq-mean-token-mean", config=None, rollout_is_weights=None):
    """Eq. 1 (spec §2): ``min(ρA, clip(ρ, 1-ε_low, 1+ε_high)A)``, no dual clip, ``ρ`` against ``old_log_prob``
    (the behaviour log-probs in bypass mode)."""
    _no_second_is_weight(rollout_is_weights, "ppo_clip")
    clip_low, clip_high = _clip_ratios(config)
    return clipped_policy_loss(log_prob, old_log_prob, advantages, response_mask, clip_low, clip_high,
                               loss_agg_mode=loss_agg_mode,
                               loss_normaliser=_normaliser(config, loss_agg_mode, "ppo_clip"))


def compute_policy_loss_dis(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                            config=None, rollout_is_weights=None):
    """DIS (spec §3, Eq. 8-9). ``old_log_prob`` must be the behaviour (rollout) log-probs."""
    return _dis_common(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                       rollout_is_weights, clipped=False)


def compute_policy_loss_dis_clip(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                 config=None, rollout_is_weights=None):
    """Clipped objective (``clip_ratio_low/high``) with the DIS mask: Li2SAO bootstrap (spec §4)."""
    return _dis_common(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config,
                       rollout_is_weights, clipped=True)


def compute_policy_loss_sapo_ar(old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean",
                                config=None, rollout_is_weights=None):
    """SAPO's policy term (spec §5): token-level PPO clip with broadcast turn advantages. ``log_prob`` must come
    from the restricted softmax (reserved ids excluded); the V/Q terms live in the SAPO worker, which adds them
    in the same backward pass. Named ``sapo_ar`` because verl's ``sapo`` is another algorithm."""
    if loss_agg_mode != "token-mean":
        raise ValueError(f"sapo_ar supports loss_agg_mode='token-mean' only, got {loss_agg_mode!r}")
    eps = float(config_value(config, "clip_ratio", 0.2))
    loss, clipfrac = ppo_clip_token_loss(log_prob, old_log_prob, advantages, response_mask, eps)
    batch_info = config_value(config, "global_batch_info", {}) or {}
    if batch_info.get("batch_num_tokens") is not None:  # verl's global token normaliser
        local = response_mask.to(log_prob.dtype).sum().clamp_min(1.0)
        loss = loss * local / (batch_info["batch_num_tokens"] / batch_info.get("dp_size", 1))
    return loss, {"actor/pg_clipfrac": float(clipfrac)}


# ----------------------------------------------------------------------------------------------------
# registration: add, never overwrite
# ----------------------------------------------------------------------------------------------------
def _add(registry: dict, name: str, fn) -> None:
    existing = registry.get(name)
    if existing is None:
        registry[name] = fn
    elif getattr(existing, "__qualname__", None) == fn.__qualname__ and existing.__module__ == fn.__module__:
        registry[name] = fn  # our own entry from an earlier import (e.g. a reload): refresh it
    else:
        raise RuntimeError(
            f"verl already has an entry {name!r} ({existing.__module__}.{existing.__qualname__}); "
            "async_rl never overwrites verl's registries -- rename ours"
        )


def _load_hf_replica():
    """Loader for verl's RolloutReplicaRegistry: ``rollout.engine=hf`` is our transformers engine as a
    ``RolloutReplica`` (imported only when asked for: it pulls in Ray actors and verl's checkpoint engines)."""
    from async_rl.rollout.replicas import HFReplica

    return HFReplica


def register() -> None:
    """Idempotently add our names to verl's registries."""
    _add(core_algos.ADV_ESTIMATOR_REGISTRY, "grpo_group", grpo_group_estimator)
    _add(core_algos.ADV_ESTIMATOR_REGISTRY, "sao_gae", sao_gae_estimator)
    _add(core_algos.ADV_ESTIMATOR_REGISTRY, "li2sao_group", li2sao_group_estimator)
    _add(core_algos.ADV_ESTIMATOR_REGISTRY, "sapo_turn", sapo_turn_estimator)
    _add(core_algos.POLICY_LOSS_REGISTRY, "ppo_clip", compute_policy_loss_ppo_clip)
    _add(core_algos.POLICY_LOSS_REGISTRY, "dis", compute_policy_loss_dis)
    _add(core_algos.POLICY_LOSS_REGISTRY, "dis_clip", compute_policy_loss_dis_clip)
    _add(core_algos.POLICY_LOSS_REGISTRY, "sapo_ar", compute_policy_loss_sapo_ar)
    try:  # last, and guarded: the algorithm names above must register even where verl's rollout stack cannot load
        from verl.workers.rollout.replica import RolloutReplicaRegistry
    except ImportError:
        return
    _add(RolloutReplicaRegistry._registry, "hf", _load_hf_replica)


register()
