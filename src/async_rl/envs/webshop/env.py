"""``WebShopEnv``: the WebShop task behind :class:`async_rl.envs.base.Env`, with two backends.

``backend="simulator"`` (default) runs the built-in shop in process; ``backend="server"`` talks to an HTTP
server speaking the protocol of :mod:`async_rl.envs.webshop.server` (the built-in one, or a wrapper around
the real WebShop text env). A server failure raises
:class:`~async_rl.envs.webshop.server.WebShopServerError`, which the driver turns into an *aborted*
trajectory (never a reward of 0). Entry points: :func:`make_webshop_tasks`, :func:`format_webshop_prompt`,
:func:`parse_action` (the last ``<action>...</action>``), :func:`webshop_env_kwargs`. An episode ends on
``click[buy now]`` or after ``max_turns`` steps (15).

Details: docs/webshop.md (Using it).
"""

from __future__ import annotations

import random
import re
import uuid
from typing import Any, Mapping, Sequence

from async_rl.envs.base import Env, StepResult, register_env
from async_rl.envs.demonstrations import WEBSHOP_DEMONSTRATIONS
from async_rl.envs.facts import EnvFacts, register_env_facts
from async_rl.envs.markup import tag_contents
from async_rl.envs.webshop.catalog import (
    DEFAULT_NUM_GOALS,
    DEFAULT_NUM_PRODUCTS,
    DEFAULT_NUM_TEST_GOALS,
    DEFAULT_SEED,
    get_catalog,
    normalize_phrase,
)
from async_rl.envs.webshop.server import WebShopClient, WebShopServerError
from async_rl.envs.webshop.simulator import (
    SEP,
    Shop,
    ShopReply,
    WebShopSimulator,
    admissible_actions,
    get_shop,
    parse_shop_action,
)

__all__ = [
    "WebShopEnv",
    "format_webshop_prompt",
    "make_webshop_tasks",
    "make_webshop_tasks_from_config",
    "parse_action",
    "strip_instruction",
    "webshop_env_kwargs",
]

DEFAULT_MAX_TURNS = 15
DEFAULT_HISTORY_LENGTH = 2
BACKENDS = ("simulator", "server")

_INSTRUCTION_HEAD_RE = re.compile(r"^(?:WebShop \[SEP\] )?Instruction: \[SEP\] (.*?) \[SEP\] ", re.DOTALL)


def parse_action(text: str) -> str | None:
    """The stripped content of the last ``<action>...</action>`` in ``text``, or None (none / empty)."""
    found = tag_contents(text or "", "action", ignore_case=True)
    if not found:
        return None
    action = " ".join(found[-1].split())
    return action or None


def strip_instruction(observation: str, instruction: str | None = None) -> str:
    """Drop WebShop's ``"[WebShop [SEP] ]Instruction: [SEP] <instruction> [SEP] "`` page header."""
    if instruction:
        for head in (f"WebShop{SEP}Instruction:{SEP}{instruction}{SEP}", f"Instruction:{SEP}{instruction}{SEP}"):
            if observation.startswith(head):
                return observation[len(head):]
    match = _INSTRUCTION_HEAD_RE.match(observation)
    return observation[match.end():] if match else observation


def _instruction_from_observation(observation: str) -> str | None:
    match = _INSTRUCTION_HEAD_RE.match(observation)
    return match.group(1) if match else None


def format_webshop_prompt(
    instruction: str,
    page: str,
    available_actions: Mapping[str, Any],
    history: Sequence[tuple[str, str]] = (),
    step: int = 1,
    max_turns: int = DEFAULT_MAX_TURNS,
    note: str | None = None,
) -> str:
    """The user message for one step. ``page``: the current page without its instruction header;
    ``history``: the recent ``(page, action)`` pairs, oldest first; ``note``: feedback on the last
    response (e.g. that it was invalid)."""
    lines = ["You are an expert online shopper using the WebShop website.", f"Your task: {instruction}", ""]
    if history:
        first = step - len(history)
        lines.append(f"Your last {len(history)} step(s), oldest first:")
        for offset, (old_page, action) in enumerate(history):
            lines.append(f"[Step {first + offset}] Page: {old_page}")
            lines.append(f"[Step {first + offset}] Action: {action}")
        lines.append("")
    if note:
        lines += [note, ""]
    lines.append(f"This is step {step} of at most {max_turns}. Current page: {page}")
    lines.append("")
    lines.append("Admissible actions: " + ", ".join(admissible_actions(available_actions)))
    lines.append("")
    lines.append(
        "First reason step by step about the page and the task inside <think> </think>. Then give exactly "
        "one admissible action inside <action> </action>, for example <action>search[red running shoes]</action> "
        "or <action>click[buy now]</action>."
    )
    return "\n".join(lines)


class _SimulatorBackend:
    def __init__(self, shop: Shop, max_turns: int, page_size: int = 10) -> None:
        self.simulator = WebShopSimulator(shop, max_turns=max_turns, page_size=page_size)

    def reset(self, goal_index: int) -> ShopReply:
        return self.simulator.reset(goal_index)

    def step(self, action: str) -> ShopReply:
        return self.simulator.step(action)

    def close(self) -> None:
        pass


class _ServerBackend:
    def __init__(self, url: str, timeout_s: float) -> None:
        self.client = WebShopClient(url, timeout_s=timeout_s)
        self.session_id: str | None = None

    def reset(self, goal_index: int) -> ShopReply:
        self.close()
        self.session_id = uuid.uuid4().hex
        return self.client.reset(self.session_id, goal_index)

    def step(self, action: str) -> ShopReply:
        if self.session_id is None:
            raise RuntimeError("WebShop server backend: step before reset")
        return self.client.step(self.session_id, action)

    def close(self) -> None:
        """Best effort: a server that is gone has forgotten the session anyway."""
        if self.session_id is None:
            return
        session_id, self.session_id = self.session_id, None
        try:
            self.client.close_session(session_id, timeout_s=min(self.client.timeout_s, 2.0))
        except WebShopServerError:
            pass


@register_env("webshop")
class WebShopEnv(Env):
    """WebShop with the simulator or a server backend; see the module docstring.

    Args:
        backend: ``"simulator"`` or ``"server"``.
        server_url: base URL of the server backend (``"http://127.0.0.1:3000"``).
        timeout_s: per-request timeout of the server backend, seconds.
        max_turns: steps per episode (15, as in verl-agent's WebShop setup).
        history_length: (page, action) pairs repeated in each prompt.
        catalog_seed, num_products, num_goals, num_test_goals: the simulator's synthetic catalog (must
            match the one the tasks were drawn from; ignored by the server backend).
        check_instruction: compare a task's ``instruction`` with the backend's (see module docstring).
            Turn it off for a real WebShop server with tasks that carry synthetic instructions.
        shop: use this :class:`Shop` instead of the cached synthetic one (simulator backend).
        page_size: results per search page of the simulator backend (WebShop shows 10).
    """

    max_turns = DEFAULT_MAX_TURNS

    def __init__(
        self,
        backend: str = "simulator",
        server_url: str | None = None,
        timeout_s: float = 30.0,
        max_turns: int = DEFAULT_MAX_TURNS,
        history_length: int = DEFAULT_HISTORY_LENGTH,
        catalog_seed: int = DEFAULT_SEED,
        num_products: int = DEFAULT_NUM_PRODUCTS,
        num_goals: int = DEFAULT_NUM_GOALS,
        num_test_goals: int = DEFAULT_NUM_TEST_GOALS,
        check_instruction: bool = True,
        shop: Shop | None = None,
        page_size: int = 10,
    ) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"unknown WebShop backend {backend!r}; valid: {', '.join(BACKENDS)}")
        if int(max_turns) < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if int(history_length) < 0:
            raise ValueError(f"history_length must be >= 0, got {history_length}")
        self.backend_name = backend
        self.max_turns = int(max_turns)
        self.history_length = int(history_length)
        self.check_instruction = bool(check_instruction)
        if backend == "server":
            if not server_url:
                raise ValueError("backend='server' needs server_url, e.g. 'http://127.0.0.1:3000'")
            self._backend: _SimulatorBackend | _ServerBackend = _ServerBackend(server_url, float(timeout_s))
        else:
            if shop is None:
                shop = get_shop(int(catalog_seed), int(num_products), int(num_goals), int(num_test_goals))
            # page_size: results per search page (WebShop's 10; fewer shortens a page for tiny models)
            self._backend = _SimulatorBackend(shop, self.max_turns, int(page_size))
        self._instruction: str | None = None
        self._page = ""
        self._available: dict[str, Any] = {"has_search_bar": False, "clickables": []}
        self._history: list[tuple[str, str]] = []
        self._turn = 0
        self._done = True

    # ------------------------------------------------------------------ Env API
    def reset(self, task: dict[str, Any]) -> str:
        if "goal_index" not in task:
            raise KeyError(f"webshop task {task.get('id', '?')!r} has no 'goal_index' (fields: {sorted(task)})")
        goal_index = task["goal_index"]
        if isinstance(goal_index, bool) or not isinstance(goal_index, int):
            raise ValueError(f"webshop task {task.get('id', '?')!r}: goal_index must be an int, got {goal_index!r}")
        self._done = True
        reply = self._backend.reset(goal_index)
        instruction = reply.instruction or _instruction_from_observation(reply.observation)
        if not instruction:
            raise ValueError("WebShop backend sent no instruction (neither a field nor an 'Instruction:' header)")
        expected = task.get("instruction")
        if self.check_instruction and expected and normalize_phrase(expected) != normalize_phrase(instruction):
            raise ValueError(
                f"webshop task {task.get('id', '?')!r} (goal {goal_index}) says {expected!r} but the backend's goal "
                f"is {instruction!r}: the tasks come from another catalog (or set check_instruction=False)"
            )
        self._instruction = instruction
        self._page = strip_instruction(reply.observation, instruction)
        self._available = dict(reply.available_actions)
        self._history = []
        self._turn = 0
        self._done = False
        return self._prompt()

    def step(self, action_text: str) -> StepResult:
        if self._instruction is None:
            raise RuntimeError("WebShopEnv.step called before reset")
        if self._done:
            raise RuntimeError("WebShopEnv episode is over; call reset for the next task")
        self._turn += 1
        action = parse_action(action_text)
        page_before = self._page
        if action is None:
            reward, backend_done = 0.0, False
            info: dict[str, Any] = {"invalid_action": True}
        else:
            reply = self._backend.step(action)
            reward, backend_done = float(reply.reward), bool(reply.done)
            info = dict(reply.info)
            if "invalid_action" not in info:  # e.g. the real WebShop, which reports nothing
                info["invalid_action"] = not self._is_admissible(action)
            if not backend_done:
                self._page = strip_instruction(reply.observation, self._instruction)
                self._available = dict(reply.available_actions)
        info["score"] = reward
        info["success"] = bool(info.get("success", backend_done and reward >= 1.0 - 1e-9))
        info["invalid_action"] = bool(info["invalid_action"])
        info["turn"] = self._turn
        info["action"] = action
        self._history.append((page_before, action if action is not None else "(no <action> given)"))
        if backend_done or self._turn >= self.max_turns:
            if not backend_done:
                info["out_of_turns"] = True
            self._done = True
            return StepResult(observation="", reward=reward, done=True, info=info)
        note = None
        if info["invalid_action"]:
            note = ("Your last response had no <action>...</action>." if action is None
                    else f"Your last action {action} was not admissible on that page.")
        return StepResult(observation=self._prompt(note), reward=reward, done=False, info=info)

    def close(self) -> None:
        self._backend.close()

    # ------------------------------------------------------------------ helpers
    @property
    def instruction(self) -> str | None:
        return self._instruction

    def simulator_goal(self, goal_index: int) -> dict[str, Any] | None:
        """The synthetic catalog's goal record (``query``, ``asin``, ``goal_options``, ...) behind
        ``goal_index``, e.g. to script demonstrations; None with the server backend (no catalog here)."""
        if not isinstance(self._backend, _SimulatorBackend):
            return None
        return dict(self._backend.simulator.shop.catalog.goal(goal_index))

    @property
    def available_actions(self) -> dict[str, Any]:
        """WebShop's ``{"has_search_bar", "clickables"}`` of the current page."""
        return dict(self._available)

    @property
    def admissible_actions(self) -> list[str]:
        """The current page's actions as verl-agent lists them (``search[<your query>]``, ``click[...]``);
        a property returning a list of strings, as in every env (ALFWorld's ``AlfWorldEnv.admissible_actions``)."""
        return admissible_actions(self._available)

    def _is_admissible(self, action: str) -> bool:
        parsed = parse_shop_action(action)
        if parsed is None:
            return False
        kind, argument = parsed
        if kind == "search":
            return bool(self._available.get("has_search_bar")) and bool(argument)
        return argument in {" ".join(str(c).lower().split()) for c in self._available.get("clickables", ())}

    def _prompt(self, note: str | None = None) -> str:
        history = self._history[-self.history_length:] if self.history_length else []
        return format_webshop_prompt(self._instruction or "", self._page, self._available, history,
                                     step=self._turn + 1, max_turns=self.max_turns, note=note)


def make_webshop_tasks(
    n: int,
    seed: int = 0,
    split: str = "train",
    *,
    catalog_seed: int = DEFAULT_SEED,
    num_products: int = DEFAULT_NUM_PRODUCTS,
    num_goals: int = DEFAULT_NUM_GOALS,
    num_test_goals: int = DEFAULT_NUM_TEST_GOALS,
    goal_indices: Sequence[int] | None = None,
) -> list[dict[str, Any]]:
    """``n`` task records from ``split`` (``"train"`` / ``"test"`` / ``"all"``) of the synthetic catalog.

    The split's goal indices are shuffled by a generator seeded with ``(split, seed)`` and taken in that
    order (reshuffled for another pass when ``n`` exceeds the split), so the same arguments always give
    the same list and a longer list extends a shorter one. Ids: ``f"webshop-{split}-s{seed}-{i}"``.

    ``goal_indices``: draw from these goal indices instead of the synthetic split, and attach no
    ``instruction`` / ``target_asin`` (they are unknown here). Use it for a real WebShop server, whose
    goals are not the synthetic ones: e.g. ``range(1500, 12087)`` to train and ``range(0, 500)`` to test,
    WebShop's own split; ``split`` then only names the ids.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    catalog = None
    if goal_indices is None:
        catalog = get_catalog(catalog_seed, num_products, num_goals, num_test_goals)
        pool = list(catalog.split_indices(split))
    else:
        pool = [int(i) for i in goal_indices]
        if any(i < 0 for i in pool):
            raise ValueError("goal_indices must be >= 0")
    if n and not pool:
        raise ValueError(f"no goals to draw from (split={split!r}, num_goals={num_goals}, "
                         f"num_test_goals={num_test_goals}, goal_indices={goal_indices!r})")
    rng = random.Random(f"webshop-tasks:{split}:{seed}")
    order: list[int] = []
    while len(order) < n:
        batch = list(pool)
        rng.shuffle(batch)
        order += batch
    tasks = []
    for i, goal_index in enumerate(order[:n]):
        task: dict[str, Any] = {"id": f"webshop-{split}-s{seed}-{i}", "env": "webshop", "goal_index": goal_index,
                                "split": split}
        if catalog is not None:
            goal = catalog.goal(goal_index)
            task["instruction"] = goal["instruction_text"]
            task["target_asin"] = goal["asin"]
        tasks.append(task)
    return tasks


_KWARG_KEYS = {
    "backend": "backend",
    "server_url": "server_url",
    "server_timeout_s": "timeout_s",
    "max_turns": "max_turns",
    "history_length": "history_length",
    "catalog_seed": "catalog_seed",
    "num_products": "num_products",
    "num_goals": "num_goals",
    "num_test_goals": "num_test_goals",
    "check_instruction": "check_instruction",
    "page_size": "page_size",
}


def webshop_env_kwargs(env_cfg: Mapping[str, Any]) -> dict[str, Any]:
    """``make_env("webshop", **webshop_env_kwargs(cfg.env))``: the constructor arguments named in
    ``conf/env/webshop.yaml`` (keys that are absent or None are left at their defaults)."""
    return {arg: env_cfg[key] for key, arg in _KWARG_KEYS.items() if key in env_cfg and env_cfg[key] is not None}


def make_webshop_tasks_from_config(env_cfg: Mapping[str, Any], seed: int = 0) -> list[dict[str, Any]]:
    """Training task records for ``env=webshop``: :func:`make_webshop_tasks` with ``num_tasks``, ``split``,
    the catalog keys and ``goal_range`` (``[start, stop)``, for a real WebShop server) of
    ``conf/env/webshop.yaml``."""

    def get(key: str, default: Any) -> Any:
        value = env_cfg[key] if key in env_cfg else None
        return default if value is None else value

    goal_range = get("goal_range", None)
    goal_indices = None
    if goal_range is not None:
        start, stop = (int(x) for x in goal_range)
        goal_indices = range(start, stop)
    return make_webshop_tasks(
        int(get("num_tasks", 512)), seed, str(get("split", "train")),
        catalog_seed=int(get("catalog_seed", DEFAULT_SEED)),
        num_products=int(get("num_products", DEFAULT_NUM_PRODUCTS)),
        num_goals=int(get("num_goals", DEFAULT_NUM_GOALS)),
        num_test_goals=int(get("num_test_goals", DEFAULT_NUM_TEST_GOALS)), goal_indices=goal_indices,
    )


#: how to start the built-in server (docs/webshop.md); the health check's message names it
SERVER_START_COMMAND = "python -m async_rl.envs.webshop.server --port 3000"


def check_server_at_start(env: "WebShopEnv") -> None:
    """``env.backend=server``: the server must answer ``GET /health`` now, before any model loads (not after
    hundreds of aborted trajectories). Raises ``RuntimeError`` with one line naming the URL, what failed, the
    command that starts the built-in server and the CLI keys to change. The simulator backend: nothing to check."""
    backend = getattr(env, "_backend", None)
    if not isinstance(backend, _ServerBackend):
        return
    url = backend.client.base_url
    try:
        WebShopClient(url, timeout_s=min(backend.client.timeout_s, 5.0)).health()
    except WebShopServerError as err:
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise RuntimeError(f"env.backend=server: no WebShop server answers at env.server_url={url} ({reason}); "
                           f"start one with `{SERVER_START_COMMAND}` (docs/webshop.md), point env.server_url at "
                           "yours, or use env.backend=simulator") from None


register_env_facts("webshop", EnvFacts(make_tasks=make_webshop_tasks_from_config,
                                       env_kwargs=lambda c: dict(webshop_env_kwargs(c)), takes_max_turns=True,
                                       eval_split="test", demonstrations=WEBSHOP_DEMONSTRATIONS,
                                       check_at_start=check_server_at_start))
