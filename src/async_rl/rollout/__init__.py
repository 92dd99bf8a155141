"""Rollout engines: generate completions with per-token behaviour log-probs and versions.

The names below load on first use (PEP 562), so importing a light submodule such as
``async_rl.rollout.settings`` (the CLI's config check) pulls in neither torch nor transformers.
"""

import importlib

_EXPORTS = {
    "FinishReason": "async_rl.rollout.base",
    "GenerationOutput": "async_rl.rollout.base",
    "GenerationRequest": "async_rl.rollout.base",
    "RolloutEngine": "async_rl.rollout.base",
    "RolloutService": "async_rl.rollout.base",
    "SamplingParams": "async_rl.rollout.base",
    "WeightsLike": "async_rl.rollout.base",
    "HFRolloutEngine": "async_rl.rollout.hf_engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'async_rl.rollout' has no attribute {name!r}")
