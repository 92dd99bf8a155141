"""What the entry points need to know about each env, registered by the env's own module: how its config group
becomes task records and constructor arguments, whether it is multi-turn, and its default evaluation set.
``train.py`` and ``eval.py`` look these up instead of branching on env names.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional


def _no_kwargs(env_cfg: Any) -> dict[str, Any]:
    return {}


@dataclass(frozen=True)
class EnvFacts:
    make_tasks: Callable[[Any, int], list[dict[str, Any]]]  # (env config group, seed) -> the prompt stream's tasks
    env_kwargs: Callable[[Any], dict[str, Any]] = _no_kwargs  # env config group -> constructor arguments
    multi_turn: bool = False  # the constructor takes max_turns (eval passes env.max_turns; training's episode limits)
    eval_split: Optional[str] = None  # agent task: the held-out split eval plays when no eval_sets are given
    toy_eval_set: bool = False  # eval's default set is generated from the task generator under the env's name
    check_at_start: Optional[Callable[[Any], None]] = None  # called on a probe env before the model loads


_FACTS: dict[str, EnvFacts] = {}
_LOCK = threading.Lock()


def register_env_facts(name: str, facts: EnvFacts) -> None:
    """Called once by the module that registers env ``name``; re-registering (a module reload) replaces it."""
    with _LOCK:
        _FACTS[name] = facts


def env_facts(name: str) -> EnvFacts:
    with _LOCK:
        facts = _FACTS.get(name)
        known = sorted(_FACTS)
    if facts is None:
        raise ValueError(f"env {name!r} has no registered facts (task loader, kwargs); valid: {', '.join(known)}. "
                         "A new env module calls async_rl.envs.facts.register_env_facts(name, EnvFacts(...))")
    return facts


def env_names_with_facts() -> list[str]:
    with _LOCK:
        return sorted(_FACTS)
