"""ALFWorld (text) on the real ``alfworld`` package: :class:`AlfWorldEnv`, registered as ``"alfworld"``.

Each episode plays one TextWorld PDDL game (``game.tw-pddl``) on textworld's ``PddlEnv`` wrapped in
alfworld's ``AlfredDemangler`` and ``AlfredInfos`` (the stack ``AlfredTWEnv`` uses, minus gym). Reward 1.0
when the game is won, at most ``max_turns`` (50) turns; an action that is not admissible is not sent to the
game (``info["invalid_action"]``). Entry points: :func:`make_alfworld_tasks` (scans
``$ALFWORLD_DATA/json_2.1.1/<split>/``), :func:`make_alfworld_tasks_from_config` and
:func:`alfworld_env_kwargs` (``conf/env/alfworld.yaml``), :func:`build_prompt`, :func:`parse_action`,
:func:`success_by_category`. ``alfworld`` is imported lazily: without it ``reset`` raises
:class:`AlfWorldNotInstalled` saying what to install.

Details: docs/alfworld.md (How a game is played; Install).
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from async_rl.envs.base import Env, StepResult, register_env
from async_rl.envs.demonstrations import ALFWORLD_DEMONSTRATIONS
from async_rl.envs.facts import EnvFacts, register_env_facts
from async_rl.envs.markup import tag_contents

__all__ = [
    "ALFWORLD_CATEGORIES",
    "ALFWORLD_INSTALL_HINT",
    "ALFWORLD_SPLITS",
    "ALFWORLD_TASK_TYPES",
    "AlfWorldEnv",
    "AlfWorldNotInstalled",
    "INVALID_ACTION_FEEDBACK",
    "alfworld_env_kwargs",
    "build_prompt",
    "category_of",
    "make_alfworld_tasks",
    "make_alfworld_tasks_from_config",
    "parse_action",
    "resolve_data_dir",
    "success_by_category",
]

#: ALFWorld's six task types (``TASK_TYPES`` of ``alfred_tw_env``) -> the category names of the papers.
ALFWORLD_TASK_TYPES: dict[str, str] = {
    "pick_and_place_simple": "Pick",
    "look_at_obj_in_light": "Look",
    "pick_clean_then_place_in_recep": "Clean",
    "pick_heat_then_place_in_recep": "Heat",
    "pick_cool_then_place_in_recep": "Cool",
    "pick_two_obj_and_place": "Pick2",
}
ALFWORLD_CATEGORIES: tuple[str, ...] = ("Pick", "Look", "Clean", "Heat", "Cool", "Pick2")

#: Split names accepted by :func:`make_alfworld_tasks` -> folder under ``json_2.1.1``. The ``eval_*``
#: names are the ones ``AlfredTWEnv`` uses for ``valid_seen`` / ``valid_unseen``.
ALFWORLD_SPLITS: dict[str, str] = {
    "train": "train",
    "valid_seen": "valid_seen",
    "valid_unseen": "valid_unseen",
    "valid_train": "valid_train",
    "eval_in_distribution": "valid_seen",
    "eval_out_of_distribution": "valid_unseen",
}

ALFWORLD_INSTALL_HINT = (
    "pip install alfworld==0.4.2  (text games only: it pulls textworld[pddl] and fast-downward-textworld, "
    "which builds from source with cmake and a C++ compiler; the alfworld[full] extra, torch detectors "
    "and THOR are not needed)"
)

#: Feedback for an action that is not admissible (the text the game gives for any unknown command).
INVALID_ACTION_FEEDBACK = "Nothing happens."

_JSON_DIR = "json_2.1.1"
_GAME_FILE = "game.tw-pddl"
_TRAJ_FILE = "traj_data.json"
_TASK_MARKER = "Your task is to: "
_WELCOME_RE = re.compile(r"^\s*-= Welcome to TextWorld, ALFRED! =-\s*")
_HIDDEN_COMMANDS = frozenset({"help"})  # shown to nobody: its output is a manual, not a game state

# textworld's PDDL loader (fast_downward.pddl2sas) overwrites sys.argv, swaps sys.stdout for a buffer
# while it translates, and sets module-global translator options: loading two games at once from two
# threads can corrupt a translation or leave sys.stdout pointing at a dead buffer. And every game's text
# (the intro on reset, the feedback of each step: Grammar.derive) is produced by ONE module-global tatsu
# parser (textworld.envs.pddl.textgen._PARSER), which is not thread-safe: two envs stepping at once from
# the rollout's env worker threads corrupt its context stack ("IndexError: pop from empty list" in
# tatsu/contexts.py), which aborted their episodes. Every game load, reset and step in this process goes
# through this lock (the work is pure Python under the GIL anyway).
_PDDL_LOCK = threading.Lock()
_PDDL_LOCK_TIMEOUT_S = 300.0


class AlfWorldNotInstalled(ImportError):
    """The ``alfworld`` package (or one of textworld / fast-downward-textworld) cannot be imported."""


# --------------------------------------------------------------------------------------------------
# Categories, data layout, task records (no alfworld import needed)
# --------------------------------------------------------------------------------------------------


def category_of(task_type: str) -> str:
    """``"pick_cool_then_place_in_recep"`` -> ``"Cool"``; a ``<task_type>-<Obj>-...`` folder name works too."""
    name = task_type.strip().split("-", 1)[0]
    try:
        return ALFWORLD_TASK_TYPES[name]
    except KeyError:
        raise ValueError(
            f"unknown ALFWorld task type {task_type!r}; known: {', '.join(ALFWORLD_TASK_TYPES)}"
        ) from None


def resolve_data_dir(data_dir: str | os.PathLike[str] | None = None) -> Path:
    """The ALFWorld data root: ``data_dir``, else ``$ALFWORLD_DATA``, else ``~/.cache/alfworld``.

    This is the folder ``alfworld-download`` fills (it holds ``json_2.1.1/`` and ``logic/``).
    """
    if data_dir is not None and str(data_dir) != "":
        return Path(data_dir).expanduser()
    env = os.environ.get("ALFWORLD_DATA")
    if env:
        return Path(env).expanduser()
    return Path("~/.cache/alfworld").expanduser()


_DATA_HINT = ("Run `alfworld-download` (it fills $ALFWORLD_DATA, default ~/.cache/alfworld), or set env.data_dir "
              "(or ALFWORLD_DATA) to the folder holding json_2.1.1/.")


def _split_dir(root: Path, split: str) -> Path:
    if split not in ALFWORLD_SPLITS:
        raise ValueError(f"unknown ALFWorld split {split!r}; valid: {', '.join(ALFWORLD_SPLITS)}")
    folder = ALFWORLD_SPLITS[split]
    for candidate in (root / _JSON_DIR / folder, root / folder):  # the data root, or json_2.1.1 itself
        if candidate.is_dir():
            return candidate
    if not root.is_dir():
        raise FileNotFoundError(
            f"ALFWorld data folder {root} does not exist. Run `alfworld-download` (it fills $ALFWORLD_DATA, "
            "default ~/.cache/alfworld) or point data_dir / ALFWORLD_DATA at the folder holding json_2.1.1/."
        )
    found = sorted(p.name for p in (root / _JSON_DIR if (root / _JSON_DIR).is_dir() else root).iterdir())
    # importing alfworld creates an empty ~/.cache/alfworld: an existing folder is no sign of data
    raise FileNotFoundError(
        f"no split folder {folder!r} under {root} (looked for {root / _JSON_DIR / folder}); found: {found}. "
        f"{_DATA_HINT}"
    )


def _read_json(path: Path) -> Any:
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)


def _task_type_near(game_file: Path) -> str | None:
    """``task_type`` from the ``traj_data.json`` beside a game file, or from the task folder's name."""
    traj = game_file.parent / _TRAJ_FILE
    if traj.is_file():
        try:
            value = _read_json(traj).get("task_type")
        except (OSError, ValueError, AttributeError):
            value = None
        if isinstance(value, str) and value:
            return value
    folder = game_file.parent.parent.name.split("-", 1)[0]
    return folder if folder in ALFWORLD_TASK_TYPES else None


def make_alfworld_tasks(
    data_dir: str | os.PathLike[str] | None = None,
    split: str = "train",
    limit: int | None = None,
    seed: int | None = 0,
    categories: Iterable[str] | None = None,
) -> list[dict[str, Any]]:
    """Task records for every playable game of ``split`` under the ALFWorld data root.

    Walks ``<data_dir>/json_2.1.1/<split>/<task folder>/<trial>/`` (``data_dir`` may also be the
    ``json_2.1.1`` folder itself) and keeps what ``AlfredTWEnv.collect_game_files`` keeps: a trial with a
    ``traj_data.json`` of one of the six task types, a ``game.tw-pddl`` whose ``solvable`` is true, and no
    ``movable`` / ``Sliced`` in its path. Records: ``{"id": "<split>/<task folder>/<trial>", "env":
    "alfworld", "game_file": absolute path, "category", "task_type", "split"}``, where ``split`` is the
    folder name (``eval_in_distribution`` gives ``valid_seen`` records).

    Order: sorted by id, then shuffled with ``random.Random(seed)`` unless ``seed`` is None (the sorted
    order groups the task types, so an unshuffled ``limit`` would take a single category). ``limit``
    (None or <= 0: all) keeps the first records after that. ``categories`` keeps only those categories.
    """
    root = resolve_data_dir(data_dir)
    split_dir = _split_dir(root, split)
    split = ALFWORLD_SPLITS[split]  # records name the folder: "eval_in_distribution" -> "valid_seen"
    wanted = None
    if categories is not None:
        wanted = set(categories)
        unknown = wanted - set(ALFWORLD_CATEGORIES)
        if unknown:
            raise ValueError(f"unknown categories {sorted(unknown)}; valid: {', '.join(ALFWORLD_CATEGORIES)}")
    tasks: list[dict[str, Any]] = []
    for dirpath, dirnames, filenames in os.walk(split_dir):
        dirnames.sort()
        if _TRAJ_FILE not in filenames:
            continue
        trial = Path(dirpath)
        rel = trial.relative_to(split_dir)
        if "movable" in str(rel) or "Sliced" in str(rel):
            continue
        game_file = trial / _GAME_FILE
        if not game_file.is_file():
            continue
        try:
            task_type = _read_json(trial / _TRAJ_FILE).get("task_type")
        except (OSError, ValueError, AttributeError):
            continue
        category = ALFWORLD_TASK_TYPES.get(task_type) if isinstance(task_type, str) else None
        if category is None or (wanted is not None and category not in wanted):
            continue
        try:
            solvable = _read_json(game_file).get("solvable", False)
        except (OSError, ValueError, AttributeError):
            continue
        if solvable is not True:
            continue
        tasks.append({
            "id": f"{split}/{rel.as_posix()}",
            "env": "alfworld",
            "game_file": str(game_file.resolve()),
            "category": category,
            "task_type": task_type,
            "split": split,
        })
    tasks.sort(key=lambda t: t["id"])
    if seed is not None:
        random.Random(seed).shuffle(tasks)
    if limit is not None and limit > 0:
        tasks = tasks[:limit]
    return tasks


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg[key]`` for a dict or an OmegaConf config (missing or null -> ``default``)."""
    if cfg is None:
        return default
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def make_alfworld_tasks_from_config(env_cfg: Any, seed: int = 0) -> list[dict[str, Any]]:
    """:func:`make_alfworld_tasks` from an env config (``conf/env/alfworld.yaml``).

    Reads ``data_dir`` (null -> ``$ALFWORLD_DATA``), ``split`` (train), ``num_tasks`` (0 or null: every
    game) and the optional ``categories`` list; the run ``seed`` shuffles the games.
    """
    categories = _cfg_get(env_cfg, "categories")
    tasks = make_alfworld_tasks(
        data_dir=_cfg_get(env_cfg, "data_dir"),
        split=str(_cfg_get(env_cfg, "split", "train")),
        limit=int(_cfg_get(env_cfg, "num_tasks", 0)),
        seed=seed,
        categories=list(categories) if categories is not None else None,
    )
    if not tasks:
        raise ValueError(
            f"no playable ALFWorld games in split {_cfg_get(env_cfg, 'split', 'train')!r} under "
            f"{resolve_data_dir(_cfg_get(env_cfg, 'data_dir'))} (categories: {categories}). {_DATA_HINT}"
        )
    return tasks


def alfworld_env_kwargs(env_cfg: Any) -> dict[str, Any]:
    """``AlfWorldEnv`` keyword arguments from an env config: ``max_turns``, ``history_length``, ``data_dir``."""
    kwargs: dict[str, Any] = {}
    for key in ("max_turns", "history_length"):
        value = _cfg_get(env_cfg, key)
        if value is not None:
            kwargs[key] = int(value)
    data_dir = _cfg_get(env_cfg, "data_dir")
    if data_dir is not None:
        kwargs["data_dir"] = str(data_dir)
    return kwargs


def success_by_category(results: Iterable[Any]) -> dict[str, dict[str, float]]:
    """Success counts and rates per category, plus ``"all"``.

    Each result is a mapping with ``"category"`` and ``"success"`` (a final step's ``info``, or a task
    record with ``success`` added) or a :class:`StepResult` (its ``info`` is read). Returns
    ``{category: {"episodes": n, "successes": k, "success_rate": k / n}}`` for the categories present, in
    the order Pick, Look, Clean, Heat, Cool, Pick2, then any other names (a missing category counts as
    ``"unknown"``), then ``"all"`` (always present; its rate is 0.0 when there are no results).
    """
    counts: dict[str, list[int]] = {}
    for result in results:
        info = result.info if isinstance(result, StepResult) else result
        if not isinstance(info, Mapping):
            raise TypeError(f"each result must be a mapping or a StepResult, got {type(result).__name__}")
        category = info.get("category") or "unknown"
        entry = counts.setdefault(str(category), [0, 0])
        entry[0] += 1
        entry[1] += int(bool(info.get("success", False)))
    order = [c for c in ALFWORLD_CATEGORIES if c in counts] + sorted(c for c in counts if c not in ALFWORLD_CATEGORIES)
    table: dict[str, dict[str, float]] = {}
    for name in order:
        n, k = counts[name]
        table[name] = {"episodes": n, "successes": k, "success_rate": k / n}
    n_all = sum(v[0] for v in counts.values())
    k_all = sum(v[1] for v in counts.values())
    table["all"] = {"episodes": n_all, "successes": k_all, "success_rate": k_all / n_all if n_all else 0.0}
    return table


# --------------------------------------------------------------------------------------------------
# Prompt and action parsing
# --------------------------------------------------------------------------------------------------


def parse_action(text: str) -> str | None:
    """The content of the last ``<action>...</action>`` in ``text``, normalised; None if there is none.

    Normalised: lower case, runs of whitespace collapsed to one space, surrounding quotes / backticks
    and a trailing period dropped (``<action> Go to  Desk 1. </action>`` -> ``"go to desk 1"``). An empty
    tag gives None.
    """
    found = tag_contents(text or "", "action", ignore_case=True)
    if not found:
        return None
    action = " ".join(found[-1].split()).lower()
    action = action.strip("'\"`").strip().rstrip(".").strip()
    return action or None


def _quote_actions(actions: Sequence[str]) -> str:
    return ",\n".join(f"'{a}'" for a in actions)


def build_prompt(
    task_description: str,
    observation: str,
    admissible_actions: Sequence[str],
    history: Sequence[tuple[str, str]] = (),
    history_length: int = 2,
) -> str:
    """The text shown to the policy before each step (verl-agent's ALFWorld layout, our wording).

    ``history`` holds every earlier ``(observation, action)`` pair of the episode, oldest first; the
    last ``history_length`` of them are shown (none when 0). Step numbers start at 1.
    """
    step = len(history) + 1
    lines = [f"You are an expert agent operating in the ALFRED embodied household environment. "
             f"Your task is to: {task_description}"]
    if history:
        shown = list(history)[-history_length:] if history_length > 0 else []
        first = step - len(shown)
        lines.append(f"Prior to this step, you have already taken {len(history)} step(s).")
        if shown:
            lines.append(f"Below are the most recent {len(shown)} observation(s) and the action you took after each:")
            lines.extend(
                f"[Observation {first + i}: '{obs}', Action {first + i}: '{act}']" for i, (obs, act) in enumerate(shown)
            )
        lines.append(f"You are now at step {step} and your current observation is: {observation}")
    else:
        lines.append(f"Your current observation is: {observation}")
    lines.append(f"Your admissible actions of the current situation are:\n[{_quote_actions(admissible_actions)}].")
    lines.append("")
    lines.append(
        "Now it's your turn to take an action. First reason step by step about the current situation; this "
        "reasoning MUST be enclosed within <think> </think> tags. Then choose one admissible action for this "
        "step and write it, exactly as listed, within <action> </action> tags."
    )
    return "\n".join(lines)


def _split_intro(feedback: str) -> tuple[str, str]:
    """The game's first text -> (that text without the welcome banner, the task without its final period)."""
    text = _WELCOME_RE.sub("", feedback or "").strip()
    cut = text.rfind(_TASK_MARKER)
    if cut < 0:
        return text, ""
    task = text[cut + len(_TASK_MARKER):].strip()
    return text, task[:-1] if task.endswith(".") else task


# --------------------------------------------------------------------------------------------------
# The environment
# --------------------------------------------------------------------------------------------------


def _import_alfworld() -> dict[str, Any]:
    """The classes this adapter uses from textworld and alfworld, or :class:`AlfWorldNotInstalled`."""
    try:
        import fast_downward  # noqa: F401  (textworld imports without it; PddlEnv() would fail later)
        import textworld
        from textworld.envs import PddlEnv
        from alfworld.agents.environment.alfred_tw_env import AlfredDemangler, AlfredInfos
        from alfworld.gen import goal_library
    except ModuleNotFoundError as exc:
        raise AlfWorldNotInstalled(
            f"AlfWorldEnv needs the 'alfworld' package and its text-game stack (textworld, "
            f"fast-downward-textworld); importing it failed: {exc}. Install: {ALFWORLD_INSTALL_HINT}."
        ) from exc
    return {
        "textworld": textworld,
        "PddlEnv": PddlEnv,
        "AlfredDemangler": AlfredDemangler,
        "AlfredInfos": AlfredInfos,
        "goal_library": goal_library,
    }


@register_env("alfworld")
class AlfWorldEnv(Env):
    """One ALFWorld text game per episode, played through textworld's PDDL backend; see the module doc.

    Args:
        max_turns: steps per episode (ALFWorld's usual budget is 50).
        history_length: earlier (observation, action) pairs repeated in each prompt (verl-agent uses 2).
        data_dir: ALFWorld data root used to resolve a relative ``game_file`` (default ``$ALFWORLD_DATA``).
        expert: also ask the PDDL planner for the rest of a winning plan after every reset and step
            (:attr:`expert_plan`), e.g. to script demonstrations; off in training (planning costs time).
    """

    max_turns = 50

    def __init__(
        self, max_turns: int = 50, history_length: int = 2, data_dir: str | os.PathLike[str] | None = None,
        expert: bool = False,
    ) -> None:
        if int(max_turns) < 1:
            raise ValueError(f"max_turns must be >= 1, got {max_turns}")
        if int(history_length) < 0:
            raise ValueError(f"history_length must be >= 0, got {history_length}")
        self.max_turns = int(max_turns)
        self.history_length = int(history_length)
        self.data_dir = resolve_data_dir(data_dir)  # read before alfworld's import sets $ALFWORLD_DATA
        self._mods: dict[str, Any] | None = None
        self._game: Any = None  # the wrapped textworld environment, reused across episodes
        self._busy = False
        self._closed = False
        self._done = True
        self._task: dict[str, Any] | None = None
        self._category: str | None = None
        self._task_type: str | None = None
        self._task_description = ""
        self._observation = ""
        self._admissible: list[str] = []
        self._history: list[tuple[str, str]] = []
        self._turn = 0
        self.expert = bool(expert)
        self._expert_plan: list[str] = []

    # -- properties for drivers, tests and debugging -------------------------------------------------

    @property
    def admissible_actions(self) -> list[str]:
        """The actions the current prompt lists (the game's admissible commands without ``help``)."""
        return list(self._admissible)

    @property
    def expert_plan(self) -> list[str]:
        """The planner's remaining winning commands from the current state (needs ``expert=True``)."""
        if not self.expert:
            raise RuntimeError("AlfWorldEnv.expert_plan needs AlfWorldEnv(expert=True)")
        return list(self._expert_plan)

    @property
    def task_description(self) -> str:
        return self._task_description

    @property
    def category(self) -> str | None:
        return self._category

    # -- game loading --------------------------------------------------------------------------------

    def _game_path(self, task: Mapping[str, Any]) -> Path:
        if "game_file" not in task:
            raise KeyError(f"alfworld task {task.get('id', '?')!r} has no 'game_file' field (fields: {sorted(task)})")
        path = Path(str(task["game_file"])).expanduser()
        if not path.is_absolute():
            path = self.data_dir / path
        if path.is_dir():
            path = path / _GAME_FILE
        if not path.is_file():
            raise FileNotFoundError(f"alfworld task {task.get('id', '?')!r}: game file {path} does not exist")
        return path

    def _game_source(self, path: Path) -> str | dict[str, Any]:
        """The path to load, or the game's data with its goal filled in when the grammar still has none."""
        data = _read_json(path)
        grammar = data.get("grammar", "")
        if "UNKNOWN GOAL" not in grammar:
            return str(path)
        traj = path.parent / _TRAJ_FILE
        if not traj.is_file():
            raise ValueError(f"{path}: the grammar has no goal text ('UNKNOWN GOAL') and there is no {_TRAJ_FILE}")
        params = _read_json(traj)
        goal_key = params["task_type"] + ("_slice" if params.get("pddl_params", {}).get("object_sliced") else "")
        template = self._mods["goal_library"].gdict[goal_key]["templates"][0]  # first template: deterministic
        p = params.get("pddl_params", {})
        goal = template.format(obj=p.get("object_target", "").lower(), recep=p.get("parent_target", "").lower(),
                               toggle=p.get("toggle_target", "").lower(), mrecep=p.get("mrecep_target", "").lower())
        data = dict(data)
        data["grammar"] = grammar.replace("UNKNOWN GOAL", goal.rstrip("."))
        return data

    def _new_game(self) -> Any:
        mods = self._mods
        infos = mods["textworld"].EnvInfos(won=True, admissible_commands=True, extras=["gamefile"],
                                           policy_commands=self.expert)
        game = mods["PddlEnv"](infos)
        game = mods["AlfredDemangler"](shuffle=False)(game)
        return mods["AlfredInfos"](game)

    def _load_and_reset(self, source: str | dict[str, Any]) -> Any:
        if not _PDDL_LOCK.acquire(timeout=_PDDL_LOCK_TIMEOUT_S):
            raise TimeoutError(f"waited {_PDDL_LOCK_TIMEOUT_S:g} s for another ALFWorld game call in this process")
        saved_argv = sys.argv
        try:
            if self._game is None:
                self._game = self._new_game()
            self._game.load(source)
            return self._game.reset()
        finally:
            sys.argv = saved_argv  # fast_downward.pddl2sas rebinds sys.argv to ["translate.py", "domain", "task"]
            _PDDL_LOCK.release()

    # -- Env interface -------------------------------------------------------------------------------

    def reset(self, task: dict[str, Any]) -> str:
        if self._closed:
            raise RuntimeError("AlfWorldEnv is closed")
        if self._mods is None:
            self._mods = _import_alfworld()
        path = self._game_path(task)
        task_type = task.get("task_type") or _task_type_near(path)
        category = task.get("category") or (category_of(task_type) if task_type else None)
        if category is None:
            raise ValueError(
                f"alfworld task {task.get('id', '?')!r}: cannot tell its category (no 'category' field, no "
                f"{_TRAJ_FILE} with a task_type beside {path}, folder name not <task_type>-...)"
            )
        if category not in ALFWORLD_CATEGORIES:
            raise ValueError(
                f"alfworld task {task.get('id', '?')!r}: category {category!r} is not one of {ALFWORLD_CATEGORIES}"
            )
        self._busy = True
        try:
            state = self._load_and_reset(self._game_source(path))
        finally:
            self._busy = False
        self._task = dict(task)
        self._category = category
        self._task_type = task_type
        self._observation, self._task_description = _split_intro(state.feedback)
        self._admissible = self._visible(state)
        self._expert_plan = list(state.get("policy_commands") or []) if self.expert else []
        self._history = []
        self._turn = 0
        self._done = False
        return build_prompt(self._task_description, self._observation, self._admissible, (), self.history_length)

    @staticmethod
    def _visible(state: Any) -> list[str]:
        return [c for c in state["admissible_commands"] if c not in _HIDDEN_COMMANDS]

    def step(self, action_text: str) -> StepResult:
        if self._task is None:
            raise RuntimeError("AlfWorldEnv.step called before reset")
        if self._done:
            raise RuntimeError("AlfWorldEnv episode is over; call reset for the next task")
        self._turn += 1
        action = parse_action(action_text)
        valid = action is not None and action in self._admissible
        won = False
        if valid:
            if not _PDDL_LOCK.acquire(timeout=_PDDL_LOCK_TIMEOUT_S):
                raise TimeoutError(f"waited {_PDDL_LOCK_TIMEOUT_S:g} s for another ALFWorld game call in this process")
            self._busy = True
            try:  # the step derives its feedback with textworld's shared parser: see _PDDL_LOCK
                state, _score, _game_done = self._game.step(action)
            finally:
                self._busy = False
                _PDDL_LOCK.release()
            feedback = state.feedback.strip()
            won = bool(state["won"])
            next_admissible = self._visible(state)
            if self.expert:
                self._expert_plan = list(state.get("policy_commands") or [])
        else:
            feedback = INVALID_ACTION_FEEDBACK
            next_admissible = self._admissible
        self._history.append((self._observation, action if action is not None else "(no action)"))
        self._observation = feedback
        self._admissible = next_admissible
        info: dict[str, Any] = {
            "success": won,
            "won": won,
            "invalid_action": not valid,
            "category": self._category,
            "task_type": self._task_type,
            "turn": self._turn,
            "action": action,
            "feedback": feedback,
        }
        if won:
            self._done = True
            return StepResult(observation="", reward=1.0, done=True, info=info)
        if self._turn >= self.max_turns:
            info["out_of_turns"] = True
            self._done = True
            return StepResult(observation="", reward=0.0, done=True, info=info)
        prompt = build_prompt(self._task_description, feedback, self._admissible, self._history, self.history_length)
        return StepResult(observation=prompt, reward=0.0, done=False, info=info)

    def close(self) -> None:
        """Free the planner state held by this env's copy of fast-downward's library. Idempotent.

        Each textworld PDDL env loads its own copy of ``libdownward.so`` (about 4 MiB resident); the copy
        stays mapped after ``close`` because unloading it (``fast_downward.close_lib``, i.e. ``dlclose``)
        makes the interpreter crash at exit. Reuse one env for many episodes instead of one per episode.
        Nothing is freed while a call is still running in another thread (a timed-out step).
        """
        if self._closed:
            return
        self._closed = True
        self._done = True
        game, self._game = self._game, None
        if game is None or self._busy:
            return
        lib = getattr(game.unwrapped, "downward_lib", None)
        if lib is not None:
            try:
                lib.cleanup()
            except Exception:  # noqa: BLE001 - closing is best effort
                pass


#: the ALFWorld games shipped in the repository (relative to its root), evaluated when the real data is missing
MINI_ALFWORLD_DIRS = ("recipes/data/alfworld", "tests/fixtures/alfworld")
#: splits tried, in order, on the shipped mini set when the requested one has no games there
MINI_ALFWORLD_SPLITS = ("valid_unseen", "valid_seen")
FETCH_ALFWORLD = "alfworld-download"


def _split_games(data_dir: Any, split: str) -> int:
    """Playable games of ``split`` under ``data_dir`` (0 when the folder or its game files are missing)."""
    try:
        return len(make_alfworld_tasks(data_dir=data_dir, split=split, seed=None))
    except FileNotFoundError:
        return 0


def _shown(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def alfworld_eval_data(env_cfg: Any, split: str, mini_root: Path | None = None) -> tuple[Any, str, str | None]:
    """``(env_cfg, split, note)`` with games to play: the configured data when its split has any, else (when
    ``mini_root``, the repository root, is given) the mini set shipped there, with a note saying so. The check
    looks for game files, not folders: importing alfworld creates an empty ``~/.cache/alfworld``."""
    from omegaconf import OmegaConf

    if split not in ALFWORLD_SPLITS:
        raise ValueError(f"env.eval_split={split!r} is not an ALFWorld split; valid: {', '.join(ALFWORLD_SPLITS)}")
    root = resolve_data_dir(env_cfg.get("data_dir"))
    if _split_games(root, split):
        return env_cfg, split, None
    have = [name for name in ("train", "valid_seen", "valid_unseen") if _split_games(root, name)]
    problem = (f"no ALFWorld games for env.eval_split={split} (json_2.1.1/{ALFWORLD_SPLITS[split]}/*/*/ with "
               f"traj_data.json and game.tw-pddl) under env.data_dir={root}"
               + (f"; splits with games there: {have}" if have else ""))
    fix = (f"run `{FETCH_ALFWORLD}` (it fills $ALFWORLD_DATA, default ~/.cache/alfworld), or set "
           "env.data_dir=<the folder holding json_2.1.1/>" + (f", or env.eval_split=<one of {have}>" if have else ""))
    if mini_root is not None:
        for mini_dir in (Path(mini_root) / d for d in MINI_ALFWORLD_DIRS):
            for mini_split in (split, *MINI_ALFWORLD_SPLITS):
                count = _split_games(mini_dir, mini_split)
                if count:
                    note = (f"{problem}. Evaluating the mini set shipped in the repo instead: {_shown(mini_dir)}, "
                            f"split {mini_split} ({count} game{'s' if count != 1 else ''}: a smoke test, not a "
                            f"benchmark). For the real games: {fix}.")
                    return OmegaConf.merge(env_cfg, {"data_dir": str(mini_dir)}), mini_split, note
    raise ValueError(f"{problem}. To fix: {fix}.")


register_env_facts("alfworld", EnvFacts(make_tasks=make_alfworld_tasks_from_config,
                                        env_kwargs=lambda c: dict(alfworld_env_kwargs(c)), takes_max_turns=True,
                                        eval_split="eval_out_of_distribution",
                                        demonstrations=ALFWORLD_DEMONSTRATIONS, eval_data=alfworld_eval_data))
