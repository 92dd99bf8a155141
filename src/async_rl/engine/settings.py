"""The memory/precision settings every training role takes (``trainer.precision``,
``trainer.max_tokens_per_micro_batch``, ``trainer.activation_checkpointing``, ``model.attn_implementation``),
validated once before any model loads and handed unchanged to the actor, critic and SAPO roles (in process or
on Ray workers)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Optional

from async_rl.engine.precision import PRECISIONS, validate_precision
from async_rl.validation import ATTN_IMPLEMENTATIONS, check_attn_implementation, check_settings, setting


@dataclass
class TrainingSettings:
    """How a role computes and splits its updates (``docs/engine.md`` §7). Each field a setting; a run fills them
    from ``trainer.*`` and ``model.attn_implementation`` by name (``validation.fill_from``)."""

    precision: str = setting("fp32", "bf16: bf16 compute with fp32 master weights and AdamW state | fp32",
                             choices=PRECISIONS)
    max_tokens_per_micro_batch: Optional[int] = setting(None, "padded-token budget per forward/backward; null = no "
                                                              "budget", range=">= 1")
    activation_checkpointing: bool = setting(False, "recompute decoder blocks in backward instead of storing "
                                                    "activations")
    attn_implementation: str = setting("sdpa", "the trained models' attention kernels (model.attn_implementation), "
                                               "applied when a role loads its model (model_kwargs)",
                                       choices=ATTN_IMPLEMENTATIONS)
    device: str = setting("cpu", "where the roles train; flash_attention_2 is checked against it", non_empty=True)

    def validate(self) -> "TrainingSettings":
        """Raise a one-line error naming the bad key; return self."""
        validate_precision(self.precision)
        check_attn_implementation(self.attn_implementation, self.device, self.precision)
        check_settings(self, "trainer")  # the token budget and the checkpointing flag (trainer.* keys)
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
