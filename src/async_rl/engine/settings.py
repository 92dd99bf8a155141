"""The memory/precision settings every training role takes (``trainer.precision``,
``trainer.max_tokens_per_micro_batch``, ``trainer.activation_checkpointing``, ``model.attn_implementation``),
validated once before any model loads and handed unchanged to the actor, critic and SAPO roles (in process or
on Ray workers)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from async_rl.engine.precision import validate_precision
from async_rl.validation import check_attn_implementation


@dataclass(frozen=True)
class TrainingSettings:
    """How a role computes and splits its updates. See ``docs/engine.md`` §7.

    Attributes:
        precision: ``"bf16"`` (bf16 compute, fp32 master weights and AdamW state) or ``"fp32"``.
        max_tokens_per_micro_batch: padded-token budget per forward/backward; ``None`` = no budget.
        activation_checkpointing: recompute decoder blocks in backward instead of storing activations.
        attn_implementation: the trained models' attention kernels (``model.attn_implementation``:
            sdpa, flash_attention_2, eager); applied when a role loads its model (:meth:`model_kwargs`).
        device: where the roles train; flash_attention_2 is checked against it.
    """

    precision: str = "fp32"
    max_tokens_per_micro_batch: Optional[int] = None
    activation_checkpointing: bool = False
    attn_implementation: str = "sdpa"
    device: str = "cpu"

    def validate(self) -> "TrainingSettings":
        """Raise a one-line error naming the bad key; return self."""
        validate_precision(self.precision)
        check_attn_implementation(self.attn_implementation, self.device, self.precision)
        budget = self.max_tokens_per_micro_batch
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int) or budget < 1):
            raise ValueError(f"trainer.max_tokens_per_micro_batch={budget!r}; use an integer >= 1 or null")
        if not isinstance(self.activation_checkpointing, bool):
            raise ValueError(f"trainer.activation_checkpointing={self.activation_checkpointing!r}; use true or false")
        return self

    def role_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :class:`ActorRole`, :class:`CriticRole` and :class:`SapoRole`."""
        kwargs = asdict(self)
        for model_key in ("attn_implementation", "device"):
            kwargs.pop(model_key)
        return kwargs

    def model_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of :func:`async_rl.models.loading.load_causal_lm` for a trained model."""
        return {"attn_implementation": self.attn_implementation}
