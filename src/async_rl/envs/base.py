"""The one environment interface shared by every task (math, ReTool, ALFWorld, WebShop, toy tasks).

    env = make_env("math")
    prompt = env.reset({"id": "q1", "prompt": "What is 2+3?", "answer": "5"})
    result = env.step("... so the answer is \\boxed{5}")   # StepResult(observation, reward, done, info)

Rollout drivers never call an env directly: :mod:`async_rl.envs.calls` runs every call on a worker thread with a
timeout and turns an exception, a hang or an invalid return value into an *aborted* outcome: dropped, never a
reward (spec §1). Registry: ``@register_env("name")`` and :func:`make_env`.

Details: docs/tasks.md (Environment interface).
"""

from __future__ import annotations

import abc
import importlib
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, TypeVar

__all__ = ["Env", "StepResult", "make_env", "register_env", "registered_env_names"]


@dataclass
class StepResult:
    """What one environment step returns.

    Attributes:
        observation: text shown to the policy next (tool output, game feedback, "" when done).
        reward: scalar reward for this step (finite float).
        done: True when the episode is over; no further ``step`` calls are allowed.
        info: free-form diagnostics. Well-known keys:
            ``invalid_action`` (bool): the action could not be parsed / executed as an action;
            ``success`` (bool): the task was solved (used for success-rate metrics).
    """

    observation: str
    reward: float
    done: bool
    info: dict[str, Any] = field(default_factory=dict)


class Env(abc.ABC):
    """Base class of every environment.

    Subclasses implement :meth:`reset` and :meth:`step`, set :attr:`max_turns`, and override
    :meth:`close` if they hold resources (processes, servers, files). Environments are used by one
    driver at a time and need not be thread-safe; the timed calls of :mod:`async_rl.envs.calls` only move a call to
    another thread.
    The one exception: after a call timed out, :meth:`close` may run while that call is still stuck in
    its thread -- close should then release what the stuck call waits on (kill the process, drop the
    connection) rather than wait for it.
    """

    #: Maximum number of ``step`` calls per episode; drivers stop the episode after this many turns.
    max_turns: int = 1

    @abc.abstractmethod
    def reset(self, task: dict[str, Any]) -> str:
        """Start an episode for ``task`` (a plain dict such as ``{"id", "prompt", "answer"}``).

        Returns the initial observation: the prompt text the policy sees first.
        """

    @abc.abstractmethod
    def step(self, action_text: str) -> StepResult:
        """Apply the policy's text action and return the resulting :class:`StepResult`."""

    def close(self) -> None:
        """Release resources. Safe to call more than once. The default does nothing."""

    def __enter__(self) -> "Env":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# Registry
# --------------------------------------------------------------------------------------------------

_ENV_REGISTRY: dict[str, Callable[..., Env]] = {}
_REGISTRY_LOCK = threading.Lock()

_EnvFactory = TypeVar("_EnvFactory", bound=Callable[..., Env])


def register_env(name: str) -> Callable[[_EnvFactory], _EnvFactory]:
    """Class/function decorator: make ``make_env(name, **kwargs)`` call the decorated factory.

    Registering a different factory under a taken name raises ``ValueError`` (silently replacing a
    task would make runs irreproducible); re-registering the same object (module re-import) is fine.
    """
    if not isinstance(name, str) or not name or ":" in name:
        raise ValueError(f"env name must be a non-empty string without ':', got {name!r}")

    def decorator(factory: _EnvFactory) -> _EnvFactory:
        with _REGISTRY_LOCK:
            existing = _ENV_REGISTRY.get(name)
            same = existing is not None and (
                existing is factory
                or (getattr(existing, "__module__", None), getattr(existing, "__qualname__", None))
                == (getattr(factory, "__module__", None), getattr(factory, "__qualname__", None))
            )
            if existing is not None and not same:
                raise ValueError(
                    f"env name {name!r} is already registered to {existing!r}; pick another name for {factory!r}"
                )
            _ENV_REGISTRY[name] = factory
        return factory

    return decorator


def registered_env_names() -> list[str]:
    """Sorted names accepted by :func:`make_env`."""
    with _REGISTRY_LOCK:
        return sorted(_ENV_REGISTRY)


def make_env(name: str, **kwargs: Any) -> Env:
    """Build the environment registered as ``name`` with ``kwargs``.

    ``name`` may also be ``"package.module:ClassName"`` to use an environment that is not registered
    (the module is imported and the attribute is called with ``kwargs``).
    """
    if ":" in name:
        module_name, _, attribute = name.partition(":")
        try:
            factory = getattr(importlib.import_module(module_name), attribute)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load env {name!r}: {exc}. Use 'package.module:ClassName'.") from exc
    else:
        with _REGISTRY_LOCK:
            factory = _ENV_REGISTRY.get(name)
        if factory is None:
            valid = ", ".join(registered_env_names()) or "(none registered)"
            raise ValueError(
                f"unknown env {name!r}. Valid names: {valid}. "
                "Register new envs with @register_env(name) in a module imported by async_rl.envs, "
                "or pass 'package.module:ClassName'."
            )
    env = factory(**kwargs)
    if not isinstance(env, Env):
        raise TypeError(f"env factory for {name!r} returned {type(env).__name__}, expected an async_rl Env subclass")
    return env
