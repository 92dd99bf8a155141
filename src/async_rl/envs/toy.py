"""Two tiny embedded tasks for the demo and the CPU tests: ``toy_keys`` (multi-turn) and ``toy_echo``.

``toy_keys`` (``max_turns = 4``): ``look`` shows ``"The key is D."``; ``open D`` ends the episode, reward
1.0 iff ``D`` is the key. ``toy_echo`` (single turn): reward 1.0 iff the last ``\\boxed{...}`` holds the
prompt's digit. Both give a binary terminal reward and report ``success`` and ``invalid_action``. Entry
points: :func:`make_toy_tasks`, :func:`optimal_action`, :func:`play_episode`, :func:`parse_keys_action`,
:func:`observation_text` (the exact chat text the rollout appends after each policy message). Importing
this module registers both names.

Details: docs/toy_tasks.md (The tasks; Chat layout).
"""

from __future__ import annotations

import random
import re
from typing import Any, Sequence

from async_rl.envs.base import Env, StepResult, register_env
from async_rl.envs.demonstrations import TOY_ECHO_DEMONSTRATIONS, TOY_KEYS_DEMONSTRATIONS
from async_rl.envs.facts import EnvFacts, register_env_facts
from async_rl.envs.markup import tag_contents

__all__ = [
    "TOY_ENV_NAMES",
    "LONG_TAIL_DEFAULT",
    "TOY_KEYS_PROMPT",
    "ToyEchoEnv",
    "ToyKeysEnv",
    "echo_prompt",
    "make_toy_tasks",
    "observation_text",
    "optimal_action",
    "parse_boxed",
    "parse_keys_action",
    "play_episode",
]

TOY_ENV_NAMES: tuple[str, str] = ("toy_keys", "toy_echo")

TOY_KEYS_PROMPT = "Find the key and open the door. Actions: look, open <digit>."
KEYS_INVALID_OBSERVATION = "Invalid action."
KEYS_MAX_TURNS = 4
KEYS_THINK_OBSERVATION = "Now act."
# the long-tailed variant's forced thinking turn: median 24 tokens, p99 = 10.2x the median (sigma 1)
LONG_TAIL_DEFAULT = {"median": 24, "sigma": 1.0, "min": 4, "max": 480}

# Chat markers of the Qwen-style template used by the tiny model (and Qwen2.5 itself).
_IM_START = "<|im_start|>"
_IM_END = "<|im_end|>"

_THINK_CLOSE = "</think>"
_KEYS_ACTION_RE = re.compile(r"(look|open\s+([0-9]))")
_BOXED_RE = re.compile(r"\\boxed\{([^{}]*)\}")


def observation_text(obs: str) -> str:
    """Text the rollout appends right after the policy's ``<|im_end|>`` to show an observation.

    It closes the assistant line, opens a ``user`` turn holding ``obs`` and re-opens an assistant turn,
    exactly as the chat template renders ``[..., assistant, user(obs)]`` with ``add_generation_prompt``.
    """
    return f"\n{_IM_START}user\n{obs}{_IM_END}\n{_IM_START}assistant\n"


def keys_observation(key: int) -> str:
    """Observation returned by ``look`` in ``toy_keys``."""
    return f"The key is {int(key)}."


def echo_prompt(code: int) -> str:
    """Prompt of a ``toy_echo`` task."""
    return f"Repeat the code {int(code)} inside \\boxed{{}}."


def _strip_thinking(text: str) -> str:
    """Drop everything up to and including the last ``</think>`` (the thinking block)."""
    cut = text.rfind(_THINK_CLOSE)
    return text[cut + len(_THINK_CLOSE):] if cut >= 0 else text


def parse_keys_action(text: str) -> tuple[str, int | None] | None:
    """Parse a ``toy_keys`` message into ``("look", None)`` / ``("open", digit)``, or None if invalid."""
    body = _strip_thinking(text)
    tags = tag_contents(body, "action", ignore_case=True)
    if tags:
        candidate = tags[-1]
    else:
        lines = [line for line in body.splitlines() if line.strip()]
        if not lines:
            return None
        candidate = lines[-1]
    candidate = " ".join(candidate.split()).lower().rstrip(".").strip()
    match = _KEYS_ACTION_RE.fullmatch(candidate)
    if match is None:
        return None
    if match.group(2) is None:
        return ("look", None)
    return ("open", int(match.group(2)))


def parse_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (spaces stripped), or None when there is none."""
    found = _BOXED_RE.findall(text)
    if not found:
        return None
    return "".join(found[-1].split())


def _task_digit(task: dict[str, Any], field: str, env_name: str) -> int:
    if field not in task:
        raise KeyError(f"{env_name} task {task.get('id', '?')!r} has no {field!r} field (fields: {sorted(task)})")
    value = task[field]
    if isinstance(value, bool) or not isinstance(value, (int, str)) or not str(value).strip().isdigit():
        raise ValueError(f"{env_name} task {task.get('id', '?')!r}: {field!r} must be a digit 0-9, got {value!r}")
    digit = int(value)
    if not 0 <= digit <= 9:
        raise ValueError(f"{env_name} task {task.get('id', '?')!r}: {field!r} must be a digit 0-9, got {value!r}")
    return digit


@register_env("toy_keys")
class ToyKeysEnv(Env):
    """Find the key (``look``) and open the door with it (``open D``); see the module docstring."""

    max_turns = KEYS_MAX_TURNS

    def __init__(self) -> None:
        self._key: int | None = None
        self._turn = 0
        self._done = True
        self._thinking = False

    def reset(self, task: dict[str, Any]) -> str:
        self._key = _task_digit(task, "key", "toy_keys")
        self._turn = 0
        self._done = False
        self._thinking = task.get("forced_first_turn") is not None  # the first turn only thinks
        self.max_turns = KEYS_MAX_TURNS + int(self._thinking)
        return task.get("prompt") or TOY_KEYS_PROMPT

    def step(self, action_text: str) -> StepResult:
        if self._key is None:
            raise RuntimeError("ToyKeysEnv.step called before reset")
        if self._done:
            raise RuntimeError("ToyKeysEnv episode is over; call reset for the next task")
        if self._thinking:
            self._thinking = False
            return StepResult(observation=KEYS_THINK_OBSERVATION, reward=0.0, done=False,
                              info={"invalid_action": False, "success": False, "turn": 0, "thinking_turn": True})
        self._turn += 1
        last_turn = self._turn >= self.max_turns
        action = parse_keys_action(action_text)
        info: dict[str, Any] = {"invalid_action": action is None, "success": False, "turn": self._turn}
        if action is not None and action[0] == "open":
            success = action[1] == self._key
            info["success"] = success
            self._done = True
            return StepResult(observation="", reward=1.0 if success else 0.0, done=True, info=info)
        if last_turn:
            info["out_of_turns"] = True
            self._done = True
            return StepResult(observation="", reward=0.0, done=True, info=info)
        observation = keys_observation(self._key) if action is not None else KEYS_INVALID_OBSERVATION
        return StepResult(observation=observation, reward=0.0, done=False, info=info)

    @staticmethod
    def optimal_action(task: dict[str, Any], history: Sequence[tuple[str, str]] = ()) -> str:
        """``look`` until an observation shows the key, then ``open <key>`` (reads the key from history)."""
        for _action, observation in reversed(list(history)):
            match = re.fullmatch(r"The key is ([0-9])\.", observation.strip())
            if match:
                return f"open {match.group(1)}"
        return "look"


@register_env("toy_echo")
class ToyEchoEnv(Env):
    """Repeat the digit from the prompt inside ``\\boxed{}``; see the module docstring."""

    max_turns = 1

    def __init__(self) -> None:
        self._code: int | None = None
        self._done = True

    def reset(self, task: dict[str, Any]) -> str:
        self._code = _task_digit(task, "code", "toy_echo")
        self._done = False
        return task.get("prompt") or echo_prompt(self._code)

    def step(self, action_text: str) -> StepResult:
        if self._code is None:
            raise RuntimeError("ToyEchoEnv.step called before reset")
        if self._done:
            raise RuntimeError("ToyEchoEnv episode is over (single turn); call reset for the next task")
        self._done = True
        answer = parse_boxed(action_text)
        success = answer is not None and answer == str(self._code)
        info = {"invalid_action": answer is None, "success": success, "extracted_answer": answer, "turn": 1}
        return StepResult(observation="", reward=1.0 if success else 0.0, done=True, info=info)

    @staticmethod
    def optimal_action(task: dict[str, Any], history: Sequence[tuple[str, str]] = ()) -> str:
        """``\\boxed{<code>}``."""
        return f"\\boxed{{{int(task['code'])}}}"


_ENV_CLASSES: dict[str, type[Env]] = {"toy_keys": ToyKeysEnv, "toy_echo": ToyEchoEnv}


def _check_name(name: str) -> None:
    if name not in _ENV_CLASSES:
        raise ValueError(f"unknown toy env {name!r}; valid names: {', '.join(TOY_ENV_NAMES)}")


def make_toy_tasks(name: str, n: int, seed: int = 0, long_tail: dict[str, Any] | None = None
                   ) -> list[dict[str, Any]]:
    """``n`` task records for toy env ``name``; the same ``(name, n, seed)`` always gives the same list.

    Ids are ``f"{name}-s{seed}-{i}"`` (unique within a list and across seeds); the digits are drawn
    uniformly from 0-9 by a generator seeded with ``(name, seed)``, so a longer list extends a shorter one.
    ``long_tail`` (``toy_keys`` only): the ``forced_first_turn`` spec every task carries (keys ``median``,
    ``sigma``, ``min``, ``max``; :data:`LONG_TAIL_DEFAULT`), a forced thinking turn of long-tailed length.
    """
    _check_name(name)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if long_tail is not None and name != "toy_keys":
        raise ValueError(f"long_tail is a toy_keys option (a thinking turn before acting), not {name!r}'s")
    rng = random.Random(f"{name}:{seed}")
    tasks: list[dict[str, Any]] = []
    for i in range(n):
        digit = rng.randrange(10)
        if name == "toy_keys":
            task = {"id": f"{name}-s{seed}-{i}", "env": name, "key": digit, "prompt": TOY_KEYS_PROMPT}
            if long_tail is not None:
                task["forced_first_turn"] = {**long_tail, "seed": seed}
        else:
            task = {"id": f"{name}-s{seed}-{i}", "env": name, "code": digit, "prompt": echo_prompt(digit)}
        tasks.append(task)
    return tasks


def _env_name_of(task: dict[str, Any], env_name: str | None) -> str:
    name = env_name or task.get("env")
    if name is None:
        name = "toy_keys" if "key" in task else "toy_echo" if "code" in task else None
    if name is None:
        raise ValueError(f"cannot tell which toy env task {task.get('id', '?')!r} belongs to; pass env_name")
    _check_name(name)
    return name


def optimal_action(
    task: dict[str, Any], history: Sequence[tuple[str, str]] = (), env_name: str | None = None
) -> str:
    """Scripted optimal policy: the next action text for ``task`` given earlier ``(action, observation)`` turns.

    The env is ``env_name`` or ``task["env"]``. ``toy_keys``: ``look`` then ``open <key read from the
    observation>``; ``toy_echo``: ``\\boxed{<code>}``.
    """
    return _ENV_CLASSES[_env_name_of(task, env_name)].optimal_action(task, history)  # type: ignore[attr-defined]


def play_episode(
    task: dict[str, Any],
    policy=None,
    env_name: str | None = None,
) -> dict[str, Any]:
    """Run one episode with ``policy(task, history) -> action_text`` (default :func:`optimal_action`).

    Returns ``{"prompt", "turns": [(action, StepResult), ...], "reward", "success", "num_turns"}``
    where ``reward`` is the sum of step rewards (the terminal reward for these tasks).
    """
    name = _env_name_of(task, env_name)
    if policy is None:
        policy = lambda t, h: optimal_action(t, h, env_name=name)  # noqa: E731
    env = _ENV_CLASSES[name]()
    try:
        prompt = env.reset(task)
        history: list[tuple[str, str]] = []
        turns: list[tuple[str, StepResult]] = []
        result = None
        for _ in range(env.max_turns):
            action = policy(task, list(history))
            result = env.step(action)
            turns.append((action, result))
            history.append((action, result.observation))
            if result.done:
                break
        assert result is not None and result.done, "toy env did not end within max_turns"
    finally:
        env.close()
    return {
        "prompt": prompt,
        "turns": turns,
        "reward": float(sum(r.reward for _, r in turns)),
        "success": bool(turns[-1][1].info.get("success", False)),
        "num_turns": len(turns),
    }


def _toy_facts(name: str, demonstrations) -> EnvFacts:
    return EnvFacts(make_tasks=lambda env_cfg, seed: make_toy_tasks(name, env_cfg.num_tasks, seed=seed),
                    toy_eval_set=True, demonstrations=demonstrations)


register_env_facts("toy_keys", _toy_facts("toy_keys", TOY_KEYS_DEMONSTRATIONS))
register_env_facts("toy_echo", _toy_facts("toy_echo", TOY_ECHO_DEMONSTRATIONS))
