"""Value model (critic) built from a causal LM policy checkpoint.

:class:`CriticModel` keeps the policy's transformer backbone (``causal_lm.model`` for HF decoder
models), drops its LM head and adds a scalar value head ``nn.Linear(hidden, 1)`` (bias 0, small random
weight: initial values near 0 but not exactly 0). ``values[:, t]`` is V of the state made of tokens
``0..t``, so ``response_slice(values, R)`` aligns with the actor's response log-probs, as GAE needs.
:func:`freeze_attention` / :func:`from_pretrained_policy` freeze every ``self_attn`` / ``self_attention``
parameter; freeze *before* building the training engine.

Details: docs/engine.md (§6 Critic: alignment, init, frozen attention).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F
from torch import nn

from async_rl.models.logprobs import position_ids_from_attention_mask, response_slice

ATTENTION_NAME_MARKERS: tuple[str, ...] = ("self_attn", "self_attention")


class AttentionNotFoundError(ValueError):
    """Raised when attention freezing finds no attention parameter (unsupported architecture)."""


def freeze_attention(module: nn.Module) -> list[str]:
    """Freeze every attention parameter of ``module`` in place.

    Args:
        module: any ``nn.Module``; parameter names are matched against
            :data:`ATTENTION_NAME_MARKERS` (``self_attn`` for HF, ``self_attention`` for Megatron).

    Returns:
        The names (as in ``module.named_parameters()``) of the parameters now frozen.

    Raises:
        AttentionNotFoundError: if no parameter name matched -- the module is not an
            HF/Megatron-style transformer, and silently freezing nothing would train the
            attention the caller meant to keep fixed.
    """
    frozen: list[str] = []
    for name, param in module.named_parameters():
        if any(marker in name for marker in ATTENTION_NAME_MARKERS):
            param.requires_grad_(False)
            frozen.append(name)
    if not frozen:
        raise AttentionNotFoundError(
            f"freeze_attention: no parameter of {type(module).__name__} has a name containing "
            f"any of {ATTENTION_NAME_MARKERS}; this architecture does not use HF ('self_attn') "
            "or Megatron ('self_attention') attention naming, so there is nothing to freeze."
        )
    return frozen


def _load_causal_lm(path: str | os.PathLike) -> nn.Module:
    from transformers import AutoModelForCausalLM

    # float32 master weights: the optimizer keeps its state in the parameter dtype.
    return AutoModelForCausalLM.from_pretrained(os.fspath(path), dtype=torch.float32)


class CriticModel(nn.Module):
    """Transformer backbone of a causal LM plus a scalar value head.

    Args:
        causal_lm: an HF ``PreTrainedModel`` causal LM (e.g. ``Qwen2ForCausalLM``) or a
            path to one. Its backbone module (``base_model``, i.e. ``causal_lm.model``) is
            reused -- shared, not copied -- and its LM head is discarded.
        init_scale: approximate std of the initial values (see module docstring).
    """

    def __init__(self, causal_lm: nn.Module | str | os.PathLike, init_scale: float = 0.02):
        super().__init__()
        if isinstance(causal_lm, (str, os.PathLike)):
            causal_lm = _load_causal_lm(causal_lm)
        backbone = getattr(causal_lm, "base_model", None)
        if backbone is None or backbone is causal_lm:
            raise TypeError(
                f"CriticModel needs a causal LM with a separate backbone (HF `base_model`, e.g. "
                f"`model.model`); got {type(causal_lm).__name__}"
            )
        self.config = causal_lm.config
        self.backbone = backbone
        hidden_size = int(self.config.hidden_size)
        # float32 like the engine's master weights, whatever the checkpoint's dtype
        self.value_head = nn.Linear(hidden_size, 1, dtype=torch.float32)
        with torch.no_grad():
            self.value_head.weight.normal_(mean=0.0, std=init_scale / math.sqrt(hidden_size))
            self.value_head.bias.zero_()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Per-position state values.

        Args:
            input_ids: (bs, T) token ids (prompt left-padded, response right-padded).
            attention_mask: (bs, T) 1 on real tokens.
            position_ids: (bs, T); default counts from each row's first real token so left
                padding does not shift positions (same rule as the actor's forward).

        Returns:
            (bs, T) float32 values; ``values[:, t]`` = V(tokens 0..t); 0 on padding columns
            (``attention_mask`` 0), so a row's output does not depend on the rows batched with it.

        Precision: the backbone runs in whatever precision the caller set up (the training engine's
        autocast / FSDP mixed precision); the value head always runs in float32, so values and their
        regression targets are compared at full precision.
        """
        if position_ids is None:
            position_ids = position_ids_from_attention_mask(attention_mask)
        total = input_ids.shape[1]
        # Causal attention: columns after the last real token of every row cannot change any value,
        # and leading all-padding columns are masked out; dropping both bounds the tokens computed by
        # what the rows really hold (the token budget of async_rl.engine.microbatch counts the same way).
        real_columns = torch.nonzero((attention_mask > 0).any(dim=0)).flatten()
        start, stop = (int(real_columns[0]), int(real_columns[-1]) + 1) if real_columns.numel() else (0, total)
        hidden = self.backbone(
            input_ids=input_ids[:, start:stop],
            attention_mask=attention_mask[:, start:stop],
            position_ids=position_ids[:, start:stop],
            use_cache=False,
        ).last_hidden_state  # (bs, stop - start, hidden)
        device_type = hidden.device.type
        with torch.autocast(device_type=device_type, enabled=False):
            bias = self.value_head.bias.float() if self.value_head.bias is not None else None
            values = F.linear(hidden.float(), self.value_head.weight.float(), bias).squeeze(-1)
        values = F.pad(values, (start, total - stop))
        return torch.where(attention_mask > 0, values, torch.zeros((), dtype=values.dtype, device=values.device))

    def response_values(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        response_len: int,
    ) -> torch.Tensor:
        """(bs, R) values of the states before each response token (see module docstring)."""
        return response_slice(self.forward(input_ids, attention_mask), response_len)

    @classmethod
    def from_pretrained_policy(
        cls,
        path_or_model: nn.Module | str | os.PathLike,
        freeze_attention: bool = True,
        init_scale: float = 0.02,
    ) -> CriticModel:
        """Build a critic from a policy checkpoint (path) or an in-memory causal LM.

        Args:
            path_or_model: HF causal LM or a directory loadable by ``AutoModelForCausalLM``.
            freeze_attention: freeze all attention parameters (see :func:`freeze_attention`).
            init_scale: value-head init scale.
        """
        critic = cls(path_or_model, init_scale=init_scale)
        if freeze_attention:
            # The module-level function; the argument shadows its name in this scope.
            _freeze_attention(critic)
        return critic


_freeze_attention = freeze_attention


def from_pretrained_policy(
    path_or_model: nn.Module | str | os.PathLike,
    freeze_attention: bool = True,
    init_scale: float = 0.02,
) -> CriticModel:
    """Module-level alias of :meth:`CriticModel.from_pretrained_policy`."""
    return CriticModel.from_pretrained_policy(path_or_model, freeze_attention=freeze_attention, init_scale=init_scale)
