"""Evaluate a checkpoint: unbiased pass@k per evaluation set (AIME year) and their mean (spec §6).

    python -m async_rl.eval                       # the latest model a run exported, on the env it trained on
    python -m async_rl.eval model_dir=/ckpt/qwen2.5-1.5b env=math \\
        'eval_sets=[data/aime/aime_2024.jsonl,data/aime/aime_2025.jsonl]' n_samples=16 temperature=1.0

Arguments are ``key=value``: fields of :class:`EvalConfig` (``--help`` lists them) and ``env.KEY=VALUE``.
Each problem gets ``n_samples`` episodes with :class:`HFRolloutEngine` through the training code's
:class:`async_rl.driver.episode.Episode`; aborted and truncated episodes count as wrong and are counted
separately. :func:`evaluate_pass_at_k` feeds a printed table, ``pass_at_k.json``, ``samples.jsonl`` and
``eval.png`` under ``output_dir``. Missing data falls back to the shipped mini sets, saying so.

Details: docs/evaluation.md (How it evaluates; Options; Missing data).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
import zlib
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np

from async_rl.progress import Phase, quiet_library_output
from async_rl.validation import check_settings, describe_setting, setting, settings_fields

__all__ = ["DEFAULT_KS", "EvalConfig", "EvalSetupError", "choose_model", "evaluate_pass_at_k", "format_table", "main",
           "parse_args", "percent", "run_eval"]

REPO_ROOT = Path(__file__).resolve().parents[2]
REPO_CONF = REPO_ROOT / "conf"
#: the evaluation data shipped in the repository (used when the real sets are missing; see the docstring)
MINI_MATH_SETS_GLOB = "recipes/data/aime_*_mini.jsonl"
FETCH_AIME = ('python -c "from datasets import load_dataset; load_dataset(\'HuggingFaceH4/aime_2024\', '
              'split=\'train\').to_json(\'data/aime/aime_2024.jsonl\')"')
DEFAULT_KS: tuple[int, ...] = (1, 2, 4, 8, 16)
TOY_SETS: tuple[str, ...] = ("toy_keys", "toy_echo", "retool_toy")


# ==================================================================================================
# pass@k (pure)
# ==================================================================================================


def evaluate_pass_at_k(samples_correct: Mapping[Any, Sequence[bool]], ks: Sequence[int] = DEFAULT_KS) -> dict[str, Any]:
    """Unbiased pass@k over problems: ``mean_i [1 - C(n_i - c_i, k) / C(n_i, k)]`` (Chen et al. 2021).

    Args:
        samples_correct: problem id -> one bool per sample (n_i samples, c_i of them correct).
        ks: the k values; those larger than the smallest n_i are skipped (listed in ``skipped_k``).

    Returns:
        ``{"k": [...], "pass": [...], "skipped_k": [...], "num_problems": P,
        "per_problem": {id: {"n": n_i, "c": c_i, "pass": [pass@k_i per k]}}}``; ``pass`` is the mean over
        problems, as a fraction in [0, 1].
    """
    from async_rl.algos.metrics import pass_at_k

    if not samples_correct:
        raise ValueError("evaluate_pass_at_k needs at least one problem")
    bad = [k for k in ks if int(k) < 1]
    if bad:
        raise ValueError(f"every k must be >= 1, got {list(ks)}")
    ids = list(samples_correct)
    n = np.array([len(samples_correct[i]) for i in ids], dtype=np.int64)
    c = np.array([sum(bool(x) for x in samples_correct[i]) for i in ids], dtype=np.int64)
    empty = [i for i, count in zip(ids, n) if count == 0]
    if empty:
        raise ValueError(f"problems without samples: {empty[:5]}")
    wanted = sorted({int(k) for k in ks})
    usable = [k for k in wanted if k <= n.min()]
    # lgamma round-off gives 1 - exp(+1e-16) = -2e-16 for c = 0 (printed as "-0.0%"): clip to [0, 1], +0.0
    # turns a remaining -0.0 into 0.0
    per_k = {k: np.clip(pass_at_k(n, c, k), 0.0, 1.0) + 0.0 for k in usable}  # (P,) each
    return {
        "k": usable,
        "pass": [float(per_k[k].mean()) for k in usable],
        "skipped_k": [k for k in wanted if k not in usable],
        "num_problems": len(ids),
        "per_problem": {
            str(pid): {"n": int(n[j]), "c": int(c[j]), "pass": [float(per_k[k][j]) for k in usable]}
            for j, pid in enumerate(ids)
        },
    }


def success_and_score(tasks: Sequence[Mapping[str, Any]], trajectories: Sequence[Any], n_samples: int
                      ) -> dict[str, Any]:
    """Success rate and mean score (the episode reward, e.g. WebShop's purchase score) over all samples, and
    success per category when tasks carry one (ALFWorld: Pick, Look, Clean, Heat, Cool, Pick2, and All)."""
    per_category: dict[str, list[bool]] = {}
    successes, scores = [], []
    for position, trajectory in enumerate(trajectories):
        ok = bool(trajectory.success) and not trajectory.aborted
        successes.append(ok)
        scores.append(0.0 if trajectory.aborted else float(trajectory.reward))
        category = tasks[position // n_samples].get("category")
        if category is not None:
            per_category.setdefault(str(category), []).append(ok)
    out: dict[str, Any] = {"success_rate": float(np.mean(successes)) if successes else 0.0,
                           "score_mean": float(np.mean(scores)) if scores else 0.0}
    if per_category:
        out["success_by_category"] = {c: float(np.mean(v)) for c, v in sorted(per_category.items())}
        out["success_by_category"]["All"] = out["success_rate"]
    return out


def percent(fraction: float) -> float:
    """``100 * fraction`` for printing a rate: never below 0 and never negative zero (``f"{-0.0:.1f}"`` is
    ``"-0.0"``; ``-0.0 + 0.0`` is ``0.0``)."""
    return max(100.0 * float(fraction), 0.0) + 0.0


def format_table(sets: Mapping[str, Mapping[str, Any]], mean: Mapping[str, Any] | None) -> str:
    """Plain-text table: one row per set (name, year, problems, pass@k in %), then the mean row."""
    ks: list[int] = sorted({k for result in sets.values() for k in result["k"]})
    name_width = max([len("set"), len("mean")] + [len(name) for name in sets])
    header = f"{'set':<{name_width}}  {'year':>4}  {'problems':>8}" + "".join(f"  {f'pass@{k}':>8}" for k in ks)
    lines = [header, "-" * len(header)]

    def row(name: str, year: Any, problems: Any, result: Mapping[str, Any]) -> str:
        values = dict(zip(result["k"], result["pass"]))
        cells = "".join(f"  {percent(values[k]):>7.1f}%" if k in values else f"  {'-':>8}" for k in ks)
        return f"{name:<{name_width}}  {str(year or ''):>4}  {str(problems):>8}{cells}"

    for name, result in sets.items():
        lines.append(row(name, result.get("year"), result["num_problems"], result))
    if mean is not None and len(sets) > 1:
        lines.append("-" * len(header))
        lines.append(row("mean", "", "", mean))
    return "\n".join(lines)


# ==================================================================================================
# Config
# ==================================================================================================


@dataclass
class EvalConfig:
    """Evaluation options (``key=value`` on the command line); every field a setting (type, default, range, meaning),
    checked by :func:`async_rl.validation.check_settings`."""

    model_dir: Optional[str] = setting(None, "local Hugging Face checkpoint or run directory; null: the latest "
                                             "exported model (<runs_dir>/last_run.json)")
    env: Optional[str] = setting(None, "env name (conf/env/<env>.yaml supplies defaults); null: the env the model "
                                       "was trained on, else math")
    eval_sets: list[Any] = setting([], "files / dirs / {path, name, year, ...} mappings, or toy_keys / toy_echo / "
                                       "retool_toy; empty = env.eval_sets (toy envs: the env's own toy set)")
    n_samples: int = setting(16, "samples per problem (n)", range=">= 1")
    ks: list[int] = setting(list(DEFAULT_KS), "pass@k values (k <= n)", non_empty=True)
    temperature: float = setting(1.0, "sampling temperature (0 = greedy)", range=">= 0")
    top_p: float = setting(1.0, "nucleus sampling", range="(0, 1]")
    max_new_tokens: Optional[int] = setting(None, "tokens per model turn (null: env's)", range=">= 1")
    max_turns: Optional[int] = setting(None, "turns per episode (null: env's)", range=">= 1")
    max_response_tokens: Optional[int] = setting(None, "model + observation tokens per episode (null: env's, else "
                                                       "max_new_tokens * max_turns)", range=">= 1")
    limit: Optional[int] = setting(None, "first N problems of each set (null: all; toy sets: 32)", range=">= 1")
    seed: int = setting(0, "sampling seed (per-turn seeds derive from it)", range=f"[0, {2 ** 32 - 1}]")
    batch_size: int = setting(64, "episodes generated together", range=">= 1")
    device: str = setting("cpu", "cpu or cuda", choices=("cpu", "cuda"))
    dtype: Optional[str] = setting(None, "model dtype (null: the checkpoint's)")
    torch_threads: int = setting(0, "torch.set_num_threads on CPU (0: leave as is)", range=">= 0")
    system_prompt: Optional[str] = setting(None, "system message for every prompt")
    output_dir: Optional[str] = setting(None, "where pass_at_k.json / samples.jsonl / eval.png go; null: <run "
                                              "dir>/eval for a model a run exported, else outputs/eval")
    save_samples: bool = setting(True, "write samples.jsonl (every response)")
    plot: bool = setting(True, "write eval.png (pass@k per set, success per category)")
    runs_dir: str = setting("outputs", "training output root holding last_run.json (trainer.output_dir)",
                            non_empty=True)
    fallback_to_mini_sets: bool = setting(True, "when the env's data is missing, evaluate the mini sets shipped in "
                                                "the repo (and say so); off when you name the data (eval_sets, "
                                                "env.eval_sets, env.data_dir, env.eval_split)")
    wandb: bool = setting(False, "also log pass@k tables to wandb (offline unless WANDB_MODE=online)")


def usage() -> str:
    lines = [__doc__.strip().splitlines()[0], "", "usage: python -m async_rl.eval key=value ...", ""]
    for name, f, rule in settings_fields(EvalConfig):
        lines.append(f"  {name:<21} {describe_setting(f, rule)}")
    lines.append("  env.KEY=VALUE         override a key of conf/env/<env>.yaml")
    return "\n".join(lines)


def _load_env_cfg(name: str):
    from omegaconf import OmegaConf

    from async_rl.envs import registered_env_names
    import async_rl.envs.retool  # noqa: F401  (registers "retool")

    path = REPO_CONF / "env" / f"{name}.yaml"
    if path.is_file():
        env_cfg = OmegaConf.load(path)
        if env_cfg.get("name") is None:
            env_cfg.name = name
        return env_cfg
    if name in registered_env_names():
        return OmegaConf.create({"name": name})
    available = sorted(p.stem for p in (REPO_CONF / "env").glob("*.yaml"))
    raise ValueError(f"unknown env {name!r}: no {path} and no registered env of that name. "
                     f"Configs: {available}; registered envs: {registered_env_names()}")


def note(message: str) -> None:
    """A choice the evaluation made for the user (model, env config, data fallback), on stderr."""
    print(f"[eval] {message}", file=sys.stderr, flush=True)


def _shown(path: str | Path) -> str:
    """``path`` relative to the working directory when it is below it (shorter messages), else as is."""
    try:
        return str(Path(path).resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


@dataclass
class ModelChoice:
    """Which checkpoint to evaluate and, for a model a run exported, that run."""

    model_dir: Optional[Path]  # None: nothing found (``_validate`` says what to do)
    how: str  # "given" | "run directory" | "last run" | "none" | "stale pointer"
    info: dict[str, Any] = field(default_factory=dict)  # config.json's "async_rl" field (or the pointer)
    run_dir: Optional[Path] = None  # the run that exported it, when its directory is still there


def choose_model(model_dir: Optional[str], runs_dir: str) -> ModelChoice:
    """``model_dir`` as given (a run directory stands for its ``model/``), else the model of
    ``<runs_dir>/last_run.json``. Never raises for a missing model: :func:`_validate` does, with the fix."""
    from async_rl.models.export import exported_model_info, read_last_run, resolve_model_dir

    if model_dir:
        path = resolve_model_dir(model_dir)
        how = "given" if path == Path(model_dir).expanduser() else "run directory"
    else:
        record = read_last_run(runs_dir)
        if record is None:
            return ModelChoice(None, "none")
        path = Path(record["model_dir"])
        if not (path / "config.json").is_file():
            return ModelChoice(None, "stale pointer", dict(record))
        how = "last run"
    info = exported_model_info(path) or {}
    run_dir = None
    # outputs/<run>/model: the run is the parent (robust to a moved outputs/); else the recorded run_dir
    for candidate in ([path.parent] if path.name == "model" else []) + ([Path(info["run_dir"])]
                                                                          if info.get("run_dir") else []):
        if (candidate / "config.json").is_file() and (candidate / "metrics.jsonl").is_file():
            run_dir = candidate
            break
    return ModelChoice(path, how, info, run_dir)


def _run_env_config(run_dir: Optional[Path], env_name: str):
    """The env config a run trained with (its ``config.json``), when that run used ``env_name``; else None."""
    from omegaconf import OmegaConf

    if run_dir is None:
        return None
    try:
        env = json.loads((run_dir / "config.json").read_text()).get("env")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(env, dict) or env.get("name") != env_name:
        return None
    return OmegaConf.create(env)


# keys that name evaluation data: given by the user, there is no fallback to the shipped mini sets
_DATA_KEYS = ("eval_sets", "data_dir", "eval_split")
# EvalConfig keys where an empty value means "not given" (`make eval MODEL=` passes model_dir=)
_EMPTY_MEANS_UNSET = ("model_dir", "env", "output_dir")


def parse_args(argv: Sequence[str]):
    """``(cfg, env_cfg)`` OmegaConf objects from ``key=value`` arguments (see the module docstring).

    Resolves the defaults the docstring lists (model, env, env config, output directory), printing each
    choice; a model that cannot be found leaves ``cfg.model_dir`` null for :func:`run_eval` to report.
    """
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    main_items, env_items = [], []
    env_name = None
    valid = ", ".join(f.name for f in dataclasses.fields(EvalConfig))
    for arg in argv:
        if arg in ("-h", "--help"):
            print(usage())
            raise SystemExit(0)
        arg = arg[2:] if arg.startswith("--") else arg
        key, sep, value = arg.partition("=")
        if not sep or not key:
            raise ValueError(f"arguments are key=value, got {arg!r}; see python -m async_rl.eval --help")
        if value.strip() == "":
            if key in _EMPTY_MEANS_UNSET:
                continue
            raise ValueError(f"{key}= has no value: give one ({key}=...) or leave {key} out "
                             f"(python -m async_rl.eval --help lists the keys and defaults)")
        if key == "env":
            env_name = value
        elif key.startswith("env."):
            env_items.append(arg[len("env."):])
        else:
            main_items.append(arg)
    cfg = OmegaConf.structured(EvalConfig)
    for item in main_items:  # one at a time, so the error names the argument
        try:
            cfg = OmegaConf.merge(cfg, OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as exc:
            reason = str(getattr(exc, "msg", None) or exc).splitlines()[0]
            raise ValueError(f"bad eval argument {item!r}: {reason}\nValid keys: {valid}, env.KEY") from exc
    given = {item.split("=", 1)[0] for item in main_items}
    env_given = {item.split("=", 1)[0].split(".", 1)[0] for item in env_items}
    if "fallback_to_mini_sets" not in given and (given | env_given) & set(_DATA_KEYS):
        cfg.fallback_to_mini_sets = False  # the user named the data: evaluate exactly that

    choice = choose_model(cfg.model_dir, cfg.runs_dir)
    if choice.model_dir is not None:
        cfg.model_dir = str(choice.model_dir)
        if choice.how != "given" or choice.info:
            what = ", ".join(f"{k} {choice.info[k]}" for k in ("algorithm", "env", "step") if k in choice.info)
            source = {"last run": f"the latest exported model (from {_shown(Path(cfg.runs_dir) / 'last_run.json')})",
                      "run directory": "the model of that run directory"}.get(choice.how, "exported by async_rl")
            note(f"model: {_shown(choice.model_dir)}, {source}" + (f"; trained with {what}" if what else ""))
    if env_name is not None:
        cfg.env = env_name
        trained_on = choice.info.get("env")
        if trained_on and trained_on != env_name:
            note(f"env: {env_name}, as asked; the model was trained on {trained_on} (its settings do not apply)")
    elif cfg.env is None:
        cfg.env = str(choice.info.get("env") or "math")
        if choice.info.get("env"):
            note(f"env: {cfg.env} (the env the model was trained on; env=NAME to change)")
    env_cfg = _run_env_config(choice.run_dir, cfg.env)
    if env_cfg is not None:
        note(f"env config: the one run {_shown(choice.run_dir)} trained with (its config.json); env.KEY=VALUE "
             "overrides a key")
    else:
        env_cfg = _load_env_cfg(cfg.env)
    from async_rl.cli_config import FREE_FORM_SETTINGS

    for item in env_items:  # in order; a free-form mapping (env.dataset_config={...}) replaces, as in training
        try:
            given = OmegaConf.from_dotlist([item])
            if f"env.{item.split('=', 1)[0]}" in FREE_FORM_SETTINGS and item.split("=", 1)[0] in env_cfg:
                env_cfg[item.split("=", 1)[0]] = None
            env_cfg = OmegaConf.merge(env_cfg, given)
        except OmegaConfBaseException as exc:
            raise ValueError(f"bad env override env.{item}: {exc}") from exc
    if cfg.output_dir is None:
        cfg.output_dir = str(choice.run_dir / "eval") if choice.run_dir is not None else "outputs/eval"
    return cfg, env_cfg


class EvalSetupError(ValueError):
    """The evaluation cannot start (model, data or options); the message names the key to set and the fix."""


def _validate(cfg) -> None:
    if not cfg.model_dir:
        pointer = Path(cfg.runs_dir) / "last_run.json"
        fix = ("train one first (e.g. `make aime ALGO=li2sao SIZE=tiny` or `make train`: every run exports its "
               "policy to outputs/<run>/model), or pass a checkpoint: MODEL=<dir> (model_dir=<dir>)")
        if pointer.is_file():
            from async_rl.models.export import read_last_run

            stale = (read_last_run(cfg.runs_dir) or {}).get("model_dir")
            raise ValueError(f"model_dir is not set and {pointer} points at {stale}, which holds no model any "
                             f"more: {fix}")
        raise ValueError(f"model_dir is not set and no trained model was found ({pointer} does not exist): {fix}")
    from omegaconf import OmegaConf

    check_settings(OmegaConf.to_object(cfg) if OmegaConf.is_config(cfg) else cfg, "")  # every field's type and range
    if min(cfg.ks) < 1:
        raise ValueError(f"ks={list(cfg.ks)}: every k must be >= 1")
    if min(cfg.ks) > cfg.n_samples:
        raise ValueError(f"every k in ks={list(cfg.ks)} exceeds n_samples={cfg.n_samples}")


# ==================================================================================================
# Tasks and envs
# ==================================================================================================


def _set_year(records: Sequence[Mapping[str, Any]]) -> int | None:
    years = Counter(r["year"] for r in records if r.get("year") is not None)
    return years.most_common(1)[0][0] if years else None


def _spec_path(spec: Any) -> Optional[str]:
    """The data path of an eval-set spec (a path or a ``{path, ...}`` mapping); None for a toy set name."""
    from async_rl.data.math_data import PACKAGED_EVAL_SETS

    if isinstance(spec, str):
        return None if spec in TOY_SETS or spec in PACKAGED_EVAL_SETS else spec
    if isinstance(spec, Mapping) or hasattr(spec, "items"):
        path = spec.get("path")
        return None if path is None else str(path)
    return None


def _missing_data(specs: Sequence[Any], allow_hub: bool) -> list[str]:
    """Paths among ``specs`` that are not on disk (with ``allow_hub`` a missing path may be a Hub name)."""
    if allow_hub:
        return []
    paths = [_spec_path(spec) for spec in specs]
    return [path for path in paths if path is not None and not Path(path).expanduser().exists()]


def _math_data_hint() -> str:
    return (f"Fetch the AIME sets into data/aime/ (docs/evaluation.md, Data setup), e.g. `{FETCH_AIME}` and "
            "likewise for 2025 and 2026; or point eval_sets=[...] (env.eval_sets) at your files; or set "
            "env.allow_hub=true to load Hub names such as eval_sets=[HuggingFaceH4/aime_2024]")


def _math_specs(cfg, env_cfg, specs: list[Any]) -> list[Any]:
    """The eval-set specs of a math-like env, with the shipped mini sets standing in for missing data."""
    explicit = bool(cfg.eval_sets)
    missing = _missing_data(specs, bool(env_cfg.get("allow_hub")))
    if not missing:
        return specs
    where = f"(relative to {Path.cwd()})"
    wanted = [path for path in (_spec_path(spec) for spec in specs) if path is not None]
    if explicit or not cfg.fallback_to_mini_sets:
        key = "eval_sets" if explicit else "env.eval_sets"
        raise ValueError(f"eval set(s) not found {where}: {missing} (from {key}). {_math_data_hint()}")
    if len(missing) < len(wanted):  # part of the data is there: evaluate that part, say what is left out
        note(f"WARNING: skipping eval sets that do not exist {where}: {missing}. {_math_data_hint()}")
        return [spec for spec in specs if _spec_path(spec) not in missing]
    mini = sorted(REPO_ROOT.glob(MINI_MATH_SETS_GLOB))
    if not mini:
        raise ValueError(f"no evaluation data: none of env.eval_sets exists {where}: {missing}, and no mini set "
                         f"matches {REPO_ROOT / MINI_MATH_SETS_GLOB}. {_math_data_hint()}")
    import importlib.util

    # real competition problems that need no download: CHAMP's integer-answer ones (a pyproject dependency)
    packaged = ["champ"] if importlib.util.find_spec("champ_dataset") is not None else []
    note(f"no evaluation data: none of env.eval_sets exists {where}: {missing}. Evaluating the mini sets "
         f"shipped in recipes/data/ instead: {[_shown(path) for path in mini]} (a few problems: a smoke test, "
         f"not a benchmark)" + (", and CHAMP's 79 integer-answer competition problems (champ-dataset)"
                                if packaged else "") + f". {_math_data_hint()}")
    return [str(path) for path in mini] + packaged


def load_sets(cfg, env_cfg) -> list[tuple[str, list[dict[str, Any]]]]:
    """``[(set name, task records)]`` in the order given (missing data: see :func:`_math_specs`,
    :func:`async_rl.envs.alfworld_env.alfworld_eval_data`)."""
    from async_rl.data.math_data import load_eval_set

    import async_rl.envs  # noqa: F401 - registers the built-in envs and their facts
    from async_rl.envs.facts import env_facts

    facts = env_facts(env_cfg.name)
    specs = list(cfg.eval_sets) or list(env_cfg.get("eval_sets") or [])
    if not specs and facts.eval_split is not None:
        # agent tasks: the env config's evaluation split (ALFWorld eval_out_of_distribution, WebShop test)
        from omegaconf import OmegaConf

        split = str(env_cfg.get("eval_split") or facts.eval_split)
        if facts.eval_data is not None:  # data the split needs (ALFWorld: games on disk, else the shipped mini set)
            env_cfg, split, fallback = facts.eval_data(env_cfg, split, REPO_ROOT if cfg.fallback_to_mini_sets else None)
            if fallback:
                note(fallback)
        eval_cfg = OmegaConf.merge(env_cfg, {"split": split, "num_tasks": cfg.limit or env_cfg.get("num_tasks")})
        return [(f"{env_cfg.name}_{eval_cfg.split}", facts.make_tasks(eval_cfg, cfg.seed))]
    if not specs and facts.toy_eval_set:
        specs = [env_cfg.name]
    if not specs:
        raise ValueError(f"no evaluation sets for env {env_cfg.name!r}: pass eval_sets=[<file>,...] or set "
                         f"env.eval_sets (conf/env/{env_cfg.name}.yaml)")
    specs = _math_specs(cfg, env_cfg, specs)
    sets = []
    for spec in specs:
        if isinstance(spec, str) and spec in TOY_SETS:
            n = cfg.limit or 32
            if spec == "retool_toy":
                from async_rl.envs.retool import make_retool_toy_tasks

                tasks = make_retool_toy_tasks(n, cfg.seed)
            else:
                from async_rl.envs.toy import make_toy_tasks

                tasks = make_toy_tasks(spec, n, seed=cfg.seed)
            sets.append((spec, tasks))
            continue
        name, records = load_eval_set(spec, env_cfg, limit=cfg.limit)
        if any(name == existing for existing, _ in sets):
            raise ValueError(f"two eval sets are both named {name!r}; give one a 'name'")
        sets.append((name, records))
    return sets


def make_env_factory(env_cfg, max_turns: int) -> Callable[[], Any]:
    """``() -> Env`` for the env named ``env_cfg.name`` with its config options."""
    from async_rl.envs import make_env
    from async_rl.envs.facts import env_facts

    name = env_cfg.name
    facts = env_facts(name)
    kwargs: dict[str, Any] = dict(facts.env_kwargs(env_cfg))
    if facts.takes_max_turns:
        kwargs["max_turns"] = max_turns
    probe = make_env(name, **kwargs)  # fail now on a bad name or option, not inside every episode
    if facts.check_at_start is not None:
        facts.check_at_start(probe)
    probe.close()
    return lambda: make_env(name, **kwargs)


# ==================================================================================================
# Rollouts
# ==================================================================================================


def run_episodes(engine, formatter, env_factory, set_name: str, tasks: Sequence[dict[str, Any]], n_samples: int,
                 sampling, limits, seed: int, batch_size: int, on_batch: Callable[[int], None] | None = None):
    """``n_samples`` finished :class:`Trajectory` per task, in ``(task, sample)`` order."""
    from async_rl.driver.episode import Episode

    jobs = [(index, task, sample) for index, task in enumerate(tasks) for sample in range(n_samples)]
    trajectories = []
    for start in range(0, len(jobs), batch_size):
        episodes = []
        for index, task, sample in jobs[start:start + batch_size]:
            group_id = f"{set_name}/{task['id']}"
            episode = Episode(env_factory(), task, formatter, sampling, limits, uid=f"{group_id}/s{sample}",
                              group_id=group_id, group_size=n_samples, prompt_index=index)
            episode.begin()
            episodes.append(episode)
        while True:
            requests, owners = [], {}
            for episode in episodes:
                request = episode.next_request()
                if request is None:
                    continue
                # request_id = f"{uid}/turn{t}": a fixed seed per (set, problem, sample, turn)
                turn_seed = zlib.crc32(f"{seed}/{request.request_id}".encode())
                request.sampling = dataclasses.replace(request.sampling, seed=turn_seed)
                requests.append(request)
                owners[request.request_id] = episode
            if not requests:
                break
            for output in engine.generate(requests):
                owners[output.request_id].on_output(output)
        trajectories.extend(episode.trajectory for episode in episodes)
        if on_batch is not None:
            on_batch(len(episodes))
    return trajectories


def run_eval(cfg, env_cfg) -> dict[str, Any]:
    """Evaluate and write ``pass_at_k.json`` (+ ``samples.jsonl``); returns the JSON content."""
    from omegaconf import OmegaConf

    try:  # every setup problem (arguments, model, data, env options) surfaces before the model loads
        _validate(cfg)
        max_turns = int(cfg.max_turns or env_cfg.get("max_turns") or 1)
        max_new_tokens = int(cfg.max_new_tokens or env_cfg.get("max_new_tokens") or 1024)
        max_response_tokens = int(cfg.max_response_tokens or env_cfg.get("max_response_tokens")
                                  or max_new_tokens * max_turns)
        env_timeout_s = float(env_cfg.get("env_timeout_s") or 60.0)
        code_timeout_s = env_cfg.get("code_timeout_s")
        if code_timeout_s is not None and env_timeout_s <= float(code_timeout_s):
            raise ValueError(f"env.env_timeout_s={env_timeout_s:g} must exceed env.code_timeout_s="
                             f"{code_timeout_s:g}, or every slow code run aborts its episode instead of showing a "
                             "timeout to the model")
        sets = load_sets(cfg, env_cfg)
        env_factory = make_env_factory(env_cfg, max_turns)
        from async_rl.models.loading import load_tokenizer

        load_tokenizer(cfg.model_dir)  # a broken tokenizer (TokenizerLoadError) is a setup error too, in one line
    except (ValueError, FileNotFoundError, ImportError) as exc:  # ImportError: an env's package (its install line)
        raise EvalSetupError(str(exc)) from exc

    import torch

    from async_rl.driver.episode import ChatFormatter, EpisodeLimits
    from async_rl.rollout.base import SamplingParams
    from async_rl.rollout.hf_engine import HFRolloutEngine

    if cfg.device == "cpu" and cfg.torch_threads:
        torch.set_num_threads(int(cfg.torch_threads))
    torch.manual_seed(cfg.seed)
    from async_rl.models.export import banned_token_ids_of

    quiet_library_output()  # the "Loading weights" bar would come before the eval's own display
    engine = HFRolloutEngine(cfg.model_dir, device=cfg.device, dtype=cfg.dtype)
    formatter = ChatFormatter(engine.tokenizer, system_prompt=cfg.system_prompt)
    stop_ids = (formatter.end_token_id,) if formatter.end_token_id is not None else ()
    # a SAPO policy never samples its two value-readout ids (recorded in its config.json by the export)
    banned = banned_token_ids_of(cfg.model_dir)
    if banned:
        note(f"banning the SAPO value-readout ids {list(banned)} in sampling, as in training")
    sampling = SamplingParams(temperature=cfg.temperature, top_p=cfg.top_p, max_new_tokens=max_new_tokens,
                              stop_token_ids=stop_ids, banned_token_ids=banned,
                              stop_strings=tuple(env_cfg.get("stop_strings") or ()))
    # the task's own reward, unshaped: no overlong penalty in evaluation
    limits = EpisodeLimits(max_turns=max_turns, max_response_tokens=max_response_tokens, env_timeout_s=env_timeout_s,
                           overlong_penalty=False, max_context_tokens=engine.max_positions)

    out_dir = Path(cfg.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    samples_file = (out_dir / "samples.jsonl").open("w") if cfg.save_samples else None
    results: dict[str, dict[str, Any]] = {}
    started = time.perf_counter()
    try:
        for set_name, tasks in sets:
            total = len(tasks) * cfg.n_samples
            # stderr, as every [eval] note: stdout carries the table
            with Phase(f"[eval] {set_name}", total=total, unit="sample", stream=sys.stderr,
                       detail=f"{len(tasks)} problems x {cfg.n_samples} samples") as phase:
                done = [0]

                def progress(count: int, phase: Phase = phase, done: list = done) -> None:
                    done[0] += count
                    phase.update(done[0])

                trajectories = run_episodes(engine, formatter, env_factory, set_name, tasks, cfg.n_samples,
                                            sampling, limits, cfg.seed, cfg.batch_size, on_batch=progress)
            correct: dict[str, list[bool]] = {str(t["id"]): [] for t in tasks}
            aborted: Counter = Counter()
            truncated: Counter = Counter()
            for position, trajectory in enumerate(trajectories):
                task = tasks[position // cfg.n_samples]
                task_id = str(task["id"])
                ok = bool(trajectory.success) and not trajectory.aborted
                correct[task_id].append(ok)
                aborted[task_id] += int(trajectory.aborted)
                truncated[task_id] += int(trajectory.truncated)
                if samples_file is not None:
                    samples_file.write(json.dumps({
                        "set": set_name, "problem_id": task_id, "sample": position % cfg.n_samples,
                        "answer": task.get("answer"), "correct": ok, "reward": trajectory.reward,
                        "aborted": trajectory.aborted, "abort_reason": trajectory.abort_reason,
                        "truncated": trajectory.truncated, "num_turns": trajectory.num_turns,
                        "response": engine.tokenizer.decode(trajectory.response_ids, skip_special_tokens=False),
                    }) + "\n")
            result = evaluate_pass_at_k(correct, cfg.ks)
            result.update(success_and_score(tasks, trajectories, cfg.n_samples))
            for task_id, counts in result["per_problem"].items():
                counts["aborted"] = aborted[task_id]
                counts["truncated"] = truncated[task_id]
            result["year"] = _set_year(tasks)
            result["n_samples"] = cfg.n_samples
            result["aborted"] = sum(aborted.values())
            if result["aborted"]:
                print(f"[eval] WARNING {set_name}: {result['aborted']} samples aborted (env/sandbox failure); "
                      "counted as wrong, see samples.jsonl", file=sys.stderr)
            results[set_name] = result
    finally:
        if samples_file is not None:
            samples_file.close()

    common_ks = sorted(set.intersection(*(set(r["k"]) for r in results.values())))
    mean = {"k": common_ks,
            "pass": [float(np.mean([dict(zip(r["k"], r["pass"]))[k] for r in results.values()])) for k in common_ks],
            "num_sets": len(results)}
    metrics = {f"eval/{name}/pass@{k}": p for name, r in results.items() for k, p in zip(r["k"], r["pass"])}
    metrics.update({f"eval/mean/pass@{k}": p for k, p in zip(mean["k"], mean["pass"])})
    from async_rl.run_dir import model_identity

    report = {
        "model_dir": str(cfg.model_dir),
        # which model these numbers are of (plots draw them only next to a run whose model/ matches)
        "model": model_identity(cfg.model_dir),
        "env": str(env_cfg.name),
        "n_samples": int(cfg.n_samples),
        "temperature": float(cfg.temperature),
        "max_new_tokens": max_new_tokens,
        "max_turns": max_turns,
        "seed": int(cfg.seed),
        "sets": results,
        "mean": mean,
        "metrics": metrics,
        "wall_s": time.perf_counter() - started,
        "config": OmegaConf.to_container(cfg, resolve=True),
        "env_config": OmegaConf.to_container(env_cfg, resolve=True),
    }
    (out_dir / "pass_at_k.json").write_text(json.dumps(report, indent=2) + "\n")
    if cfg.plot:
        from async_rl.plots import plot_eval

        report["plot"] = str(plot_eval(report, out_dir / "eval.png"))
    if cfg.wandb:
        _log_wandb(report, out_dir, cfg)
    print(f"\npass@k, n={cfg.n_samples} samples per problem, temperature {cfg.temperature:g} ({env_cfg.name}; "
          f"{cfg.model_dir})")
    print(format_table(results, mean))
    for name, r in results.items():
        line = f"{name}: success {percent(r['success_rate']):.1f}%, score {r['score_mean'] + 0.0:.3f}"
        if "success_by_category" in r:
            line += " | " + ", ".join(f"{c} {percent(v):.1f}%" for c, v in r["success_by_category"].items())
        print(line)
    print(f"\nwrote {out_dir / 'pass_at_k.json'}" + (f" and {report['plot']}" if cfg.plot else ""))
    return report


def _log_wandb(report: dict[str, Any], out_dir: Path, cfg) -> None:
    """pass@k per set (and success per category) as wandb Tables with bar plots; offline unless the user set
    WANDB_MODE=online."""
    from async_rl.tracking import RunLogger

    logger = RunLogger(out_dir, "async_rl-eval", f"eval-{report['env']}", {"eval": report["config"]})
    try:
        for name, result in report["sets"].items():
            logger.log_table(f"eval/{name}/pass_at_k", ["k", "pass"],
                             [[f"pass@{k}", p] for k, p in zip(result["k"], result["pass"])])
            if "success_by_category" in result:
                logger.log_table(f"eval/{name}/success_by_category", ["category", "success"],
                                 [[c, v] for c, v in result["success_by_category"].items()])
        logger.log(report["metrics"], step=0)
    finally:
        logger.close()


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    cfg, env_cfg = parse_args(sys.argv[1:] if argv is None else argv)
    return run_eval(cfg, env_cfg)


def _cli() -> None:
    """``python -m async_rl.eval``: setup errors (arguments, model, data) print their one-line fix, no traceback."""
    from async_rl.data.math_data import MathDataError
    from async_rl.models.loading import ModelPathError

    try:
        cfg, env_cfg = parse_args(sys.argv[1:])
    except ValueError as exc:  # a usage error: the message says what to fix
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    try:
        run_eval(cfg, env_cfg)
    except (EvalSetupError, MathDataError, ModelPathError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    _cli()
