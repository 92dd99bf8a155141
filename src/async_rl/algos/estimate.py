"""What an advantage estimator returns, and how it reads its settings (spec §2-§5).

Every estimator is registered by name in verl's ``ADV_ESTIMATOR_REGISTRY`` (``async_rl.verl_plugin``) and called
with verl's keyword arguments (``token_level_rewards``, ``response_mask``, ``index``, ``values``, ``config``)
plus the batch fields it needs (``scores``, ``responses``, ``response_attention``, SAPO's turn tensors). It
returns an :class:`AdvantageEstimate`: a 2-tuple ``(advantages, returns)``, so stock verl's
``compute_advantage`` unpacks it as it unpacks its own estimators, carrying what a trainer with a critic also
needs as attributes.
"""

from __future__ import annotations

from typing import Any, Optional

import torch


class AdvantageEstimate(tuple):
    """``(advantages, returns)``, shapes ``(bs, T)``, plus the critic's side of the estimate.

    Attributes:
        critic_targets: ``(bs, T)`` what the critic regresses on this batch (the returns, or Li2SAO's residual
            targets); None when the algorithm trains no critic from this estimate.
        critic_mask: ``(bs, T)`` tokens the critic loss covers (None: no critic update).
        value_clip: ε_v of a clipped value loss around V_old; None = plain squared error.
        ranking: Li2SAO's ranking-loss inputs (Eq. 11), or None.
        turn_targets: SAPO's turn-level side (spec §5): ``(bs, K)`` tensors ``turn_mask``, ``advantages`` (A),
            ``norm_advantages`` (Â), ``y_v``, ``y_q``; None for token-level estimators.
        metrics: scalars to log for this batch.
    """

    critic_targets: Optional[torch.Tensor]
    critic_mask: Optional[torch.Tensor]
    value_clip: Optional[float]
    ranking: Optional[dict]
    turn_targets: Optional[dict]
    metrics: dict[str, float]

    def __new__(cls, advantages: torch.Tensor, returns: torch.Tensor, *,
                critic_targets: Optional[torch.Tensor] = None, critic_mask: Optional[torch.Tensor] = None,
                value_clip: Optional[float] = None, ranking: Optional[dict] = None,
                turn_targets: Optional[dict] = None, metrics: Optional[dict[str, float]] = None
                ) -> "AdvantageEstimate":
        out = super().__new__(cls, (advantages, returns))
        out.critic_targets = critic_targets
        out.critic_mask = critic_mask
        out.value_clip = value_clip
        out.ranking = ranking
        out.turn_targets = turn_targets
        out.metrics = dict(metrics or {})
        return out

    @property
    def advantages(self) -> torch.Tensor:
        return self[0]

    @property
    def returns(self) -> torch.Tensor:
        return self[1]


def config_value(config: Any, key: str, default: Any, alias: Optional[str] = None) -> Any:
    """``key`` (or its verl-side ``alias``) from our ``AlgorithmConfig``, a verl config dataclass, a DictConfig, a
    dict, or None (the default). A value of None counts as unset."""
    for name in (key, alias):
        if name is None or config is None:
            continue
        if isinstance(config, dict):
            value = config.get(name)
        else:
            getter = getattr(config, "get", None)
            value = None
            if callable(getter):
                try:
                    value = getter(name, None)
                except Exception:  # noqa: BLE001 - some verl configs raise on unknown keys
                    value = None
            if value is None:
                value = getattr(config, name, None)
        if value is not None:
            return value
    return default
