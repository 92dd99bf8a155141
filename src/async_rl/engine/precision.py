"""Compute precision of a training engine (``trainer.precision``) and the "inside the root call" hook.

``"fp32"``: everything in float32. ``"bf16"``: master weights, gradients and AdamW state stay float32;
only the forward/backward math runs in bfloat16, under ``torch.autocast`` around the root module's
forward (:func:`install_root_forward`) plus, when sharded, FSDP2's ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)``; without bf16 autocast on the device (:func:`bf16_supported`) it falls back to
float32 with a warning. :func:`call_inside_root` runs ``fn(module, **kwargs)`` as the body of
``module(...)``, so FSDP's hooks and the precision context wrap it like a normal forward (chunked
log-probs, SAPO's readouts).

Details: docs/engine.md (§7 Precision and memory-bounded updates: "Precision", "Inside the root call").
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

logger = logging.getLogger(__name__)

PRECISIONS: tuple[str, ...] = ("bf16", "fp32")

# Keyword the installed root forward recognises; a name no Hugging Face model uses.
_RUN_INSIDE_KWARG = "_async_rl_run_inside_root"
_INSTALLED_ATTR = "_async_rl_root_forward_installed"


def validate_precision(precision: str) -> str:
    """Return ``precision`` if it is one of :data:`PRECISIONS`, else raise a one-line error."""
    if precision not in PRECISIONS:
        raise ValueError(f"trainer.precision={precision!r}; valid choices: {', '.join(PRECISIONS)}")
    return precision


def bf16_supported(device: torch.device) -> bool:
    """True when bf16 autocast works on ``device`` (CUDA with bf16 support, or a CPU torch build)."""
    if device.type == "cuda":
        return bool(torch.cuda.is_available() and torch.cuda.is_bf16_supported())
    if not torch.amp.is_autocast_available(device.type):
        return False
    try:
        with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
            probe = torch.ones(2, 2, device=device) @ torch.ones(2, 2, device=device)
        return probe.dtype == torch.bfloat16
    except (RuntimeError, ValueError):
        return False


def resolve_compute_dtype(precision: str, device: torch.device) -> torch.dtype:
    """The dtype the forward/backward math runs in for ``precision`` on ``device``."""
    validate_precision(precision)
    if precision == "fp32":
        return torch.float32
    if bf16_supported(device):
        return torch.bfloat16
    logger.warning("trainer.precision=bf16: bf16 autocast is not supported on %s, computing in float32", device)
    return torch.float32


def compute_context(device: torch.device, compute_dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Autocast to ``compute_dtype`` on ``device`` (a no-op context for float32)."""
    if compute_dtype == torch.float32:
        return contextlib.nullcontext()
    return torch.autocast(device_type=device.type, dtype=compute_dtype)


def install_root_forward(module: nn.Module, context_factory: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Make ``module(...)`` run its forward under ``context_factory()`` and accept :func:`call_inside_root`.

    The replacement is an instance attribute, so parameter names, state dicts and FSDP2's hooks
    (registered on the module, around whatever ``forward`` is) are unchanged. ``functools.wraps`` keeps
    the original signature visible to ``inspect.signature`` (callers probe e.g. ``logits_to_keep``).
    Installing twice is an error (the second context would silently nest inside the first), and so is
    deep-copying the module afterwards (the copy would call this module's forward).
    """
    if getattr(module, _INSTALLED_ATTR, False):
        raise RuntimeError(f"{type(module).__name__} already has an engine root forward; build one engine per model")
    original_forward = module.forward

    @functools.wraps(original_forward)
    def forward(*args: Any, **kwargs: Any) -> Any:
        body = kwargs.pop(_RUN_INSIDE_KWARG, None)
        with context_factory():
            if body is None:
                return original_forward(*args, **kwargs)
            return body(module, **kwargs)

    def refuse_deepcopy(memo):
        # a copy would keep this closure, i.e. run the *original* module's forward: fail loudly instead
        raise TypeError(f"{type(module).__name__} belongs to a training engine and cannot be deep-copied; "
                        "copy the model before building the engine (as SapoRole does for its reference)")

    module.forward = forward
    module.__deepcopy__ = refuse_deepcopy
    setattr(module, _INSTALLED_ATTR, True)


def call_inside_root(module: nn.Module, fn: Callable[..., Any], **kwargs: Any) -> Any:
    """Run ``fn(module, **kwargs)`` as the body of ``module(...)`` when an engine owns ``module``.

    For a module without an engine root forward (a plain model, a frozen reference copy) this is
    just ``fn(module, **kwargs)``: there are no FSDP hooks to honour and no engine precision.
    ``fn`` must return tensors (or containers of them) so FSDP can hook the backward.
    """
    if getattr(module, _INSTALLED_ATTR, False):
        return module(**{_RUN_INSIDE_KWARG: fn}, **kwargs)
    return fn(module, **kwargs)
