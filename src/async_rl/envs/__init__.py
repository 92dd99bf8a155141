"""Environments behind one interface (:class:`async_rl.envs.base.Env`) and a name registry.

Importing this package registers the built-in environments. A new environment module registers itself
with ``@register_env("name")``; add its import below so ``make_env("name")`` finds it without the
caller importing the module first.
"""

from async_rl.envs.base import Env, StepResult, make_env, register_env, registered_env_names
from async_rl.envs.calls import EnvAborted, ResetOutcome, StepOutcome, run_env_reset, run_env_step

# Built-in environments (imported for their @register_env side effect).
from async_rl.envs import toy as _toy  # noqa: E402,F401  ("toy_keys", "toy_echo")
from async_rl.envs.math_env import MathEnv  # noqa: E402
from async_rl.envs import webshop as _webshop  # noqa: E402,F401  ("webshop")
from async_rl.envs import retool as _retool  # noqa: E402,F401  ("retool")
from async_rl.envs import alfworld_env as _alfworld  # noqa: E402,F401  ("alfworld"; the package loads lazily)
from async_rl.envs import reasoning_gym_env as _reasoning_gym  # noqa: E402,F401  ("reasoning_gym"; loads lazily)

__all__ = [
    "Env",
    "EnvAborted",
    "MathEnv",
    "ResetOutcome",
    "StepOutcome",
    "StepResult",
    "make_env",
    "register_env",
    "registered_env_names",
    "run_env_reset",
    "run_env_step",
]
