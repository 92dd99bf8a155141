"""Math prompts and answers as task records: DAPO-Math-17K for training, AIME 2024/2025/2026 for evaluation.

    records = load_math_records("data/aime/aime_2024.jsonl")
    # [{"id": "aime_2024-0", "prompt": "...", "question": "...", "answer": "204", "source": "aime_2024",
    #   "year": 2024}, ...]

:func:`load_math_records` reads ``.parquet`` / ``.jsonl`` / ``.json`` / ``.csv`` files and dataset
directories with the ``datasets`` library (a Hub name only with ``allow_hub=True``), finds the prompt,
answer, id and year columns of the common layouts (DAPO in verl format, HuggingFaceH4's AIME, ...) and keeps
one row per DAPO problem (``dedupe``). Config entry points: :func:`make_math_tasks`, :func:`load_eval_set`.

Details: docs/evaluation.md (Data setup; Supported files and columns).
"""

from __future__ import annotations

import logging
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from async_rl.rewards.math_reward import extract_answer

__all__ = [
    "ANSWER_CANDIDATES",
    "ID_CANDIDATES",
    "PROMPT_CANDIDATES",
    "MathDataError",
    "eval_set_name",
    "load_eval_set",
    "load_math_records",
    "champ_integer_records",
    "make_math_tasks",
    "strip_dapo_instruction",
]

logger = logging.getLogger(__name__)

PROMPT_CANDIDATES: tuple[str, ...] = ("prompt", "problem", "question")
ANSWER_CANDIDATES: tuple[str, ...] = (
    "answer", "reward_model.ground_truth", "ground_truth", "final_answer", "solution",
)
ID_CANDIDATES: tuple[str, ...] = (
    "id", "problem_id", "problem_idx", "idx", "index", "unique_id", "extra_info.index",
)
YEAR_CANDIDATES: tuple[str, ...] = ("year",)

_FILE_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".csv": "csv"}

# DAPO-Math-17K wraps every problem in this instruction (the model must end with "Answer: <int>").
_DAPO_INSTRUCTION = re.compile(
    r"^\s*Solve the following math problem step by step\..*?\n\n(?P<question>.*?)\n\n"
    r"Remember to put your answer on its own line after \"Answer:\"\.?\s*$",
    re.DOTALL,
)
_YEAR_IN_NAME = re.compile(r"(?<!\d)((?:19|20)\d{2})(?!\d)")
_AIME_SHORT_YEAR = re.compile(r"aime[_\-]?(\d{2})(?!\d)", re.IGNORECASE)


class MathDataError(ValueError):
    """A math data file is missing, unreadable, or lacks the needed columns (the message says which)."""


# --------------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------------


def strip_dapo_instruction(text: str) -> str:
    """The bare problem inside DAPO-Math-17K's instruction wrapper; ``text`` unchanged when not wrapped."""
    match = _DAPO_INSTRUCTION.match(text)
    return match.group("question").strip() if match else text


def eval_set_name(source: str) -> str:
    """Short name of a data source: the file stem (``data/aime_2024.jsonl`` -> ``aime_2024``), the
    directory name, or the last part of a Hub name (``HuggingFaceH4/aime_2024`` -> ``aime_2024``)."""
    path = Path(str(source).rstrip("/"))
    return path.stem if path.suffix.lower() in _FILE_BUILDERS else path.name


def _year_from_name(name: str) -> int | None:
    match = _YEAR_IN_NAME.search(name)
    if match:
        return int(match.group(1))
    match = _AIME_SHORT_YEAR.search(name)
    return 2000 + int(match.group(1)) if match else None


def _cfg_get(cfg: Any, key: str, default: Any = None) -> Any:
    """``cfg.get(key, default)`` for dicts and OmegaConf configs; a present ``None`` also gives ``default``."""
    value = cfg.get(key, default) if cfg is not None else default
    return default if value is None else value


# --------------------------------------------------------------------------------------------------
# Columns
# --------------------------------------------------------------------------------------------------


def _available_fields(features: Mapping[str, Any]) -> list[str]:
    """Top-level columns plus ``parent.child`` for struct columns (one level deep)."""
    fields: list[str] = []
    for name, feature in features.items():
        fields.append(name)
        if isinstance(feature, Mapping):
            fields.extend(f"{name}.{child}" for child in feature)
    return fields


def _resolve_field(explicit: str | None, candidates: Sequence[str], available: list[str], what: str,
                   source: str, required: bool) -> str | None:
    """The actual field name to read for ``what`` (exact match first, then case-insensitive)."""
    lowered = {name.lower(): name for name in reversed(available)}  # first spelling wins
    if explicit:
        if explicit in available:
            return explicit
        if explicit.lower() in lowered:
            return lowered[explicit.lower()]
        raise MathDataError(
            f"{source}: column {explicit!r} ({what}_key) not found. Columns found: {available}"
        )
    for candidate in candidates:
        if candidate.lower() in lowered:
            return lowered[candidate.lower()]
    if required:
        raise MathDataError(
            f"{source}: no {what} column. Looked for {list(candidates)}; columns found: {available}. "
            f"Pass {what}_key=<column> (dotted paths reach into struct columns, e.g. reward_model.ground_truth)."
        )
    return None


def _get(row: Mapping[str, Any], field: str) -> Any:
    if field in row:
        return row[field]
    parent, _, child = field.partition(".")
    value = row.get(parent)
    return value.get(child) if isinstance(value, Mapping) else None


def _prompt_text(value: Any, field: str, where: str) -> str:
    """Prompt text from a string or a chat-message list (last user message)."""
    if isinstance(value, str):
        text = value
    elif isinstance(value, Sequence) and value and all(isinstance(m, Mapping) for m in value):
        users = [m for m in value if str(m.get("role", "")).lower() == "user"]
        text = (users or list(value))[-1].get("content")
        if not isinstance(text, str):
            raise MathDataError(f"{where}: chat message in column {field!r} has no text content: {value!r:.200}")
    else:
        raise MathDataError(
            f"{where}: column {field!r} must hold text or a list of chat messages, got {type(value).__name__}"
        )
    if not text.strip():
        raise MathDataError(f"{where}: empty prompt in column {field!r}")
    return text.strip()


def _answer_text(value: Any, field: str, where: str) -> str:
    if isinstance(value, bool) or value is None:
        raise MathDataError(f"{where}: missing answer in column {field!r} (got {value!r})")
    if isinstance(value, float):
        if not math.isfinite(value):
            raise MathDataError(f"{where}: non-finite answer {value!r} in column {field!r}")
        text = str(int(value)) if value.is_integer() else repr(value)
    elif isinstance(value, int):
        text = str(value)
    elif isinstance(value, str):
        text = value.strip()
    elif isinstance(value, Sequence) and len(value) == 1:  # some verl files store [answer]
        return _answer_text(value[0], field, where)
    else:
        raise MathDataError(f"{where}: answer in column {field!r} must be text or a number, got {value!r:.200}")
    if "\\boxed" in text or "\\fbox" in text:
        text = extract_answer(text) or text
    if not text:
        raise MathDataError(f"{where}: empty answer in column {field!r}")
    return text


# --------------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------------


def _load_dataset(source: str, split: str | None, allow_hub: bool, cache_dir: str | None):
    """A ``datasets.Dataset`` for a local file, a local directory, or (``allow_hub``) a Hub name."""
    import datasets

    path = Path(source).expanduser()
    try:
        if path.is_file():
            builder = _FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise MathDataError(
                    f"{source}: unsupported file type {path.suffix!r}; use one of {sorted(_FILE_BUILDERS)}"
                )
            return datasets.load_dataset(builder, data_files=str(path), split="train", cache_dir=cache_dir)
        if path.is_dir():
            return datasets.load_dataset(str(path), split=split or "train", cache_dir=cache_dir)
        if allow_hub:
            return datasets.load_dataset(source, split=split or "train", cache_dir=cache_dir)
    except MathDataError:
        raise
    except Exception as exc:  # noqa: BLE001 - pyarrow/datasets raise many types; name the file
        raise MathDataError(f"cannot read math data from {source!r}: {type(exc).__name__}: {exc}") from exc
    raise MathDataError(
        f"math data {source!r} not found: no such file or directory (relative to {Path.cwd()}). Put the file "
        "there (see docs/evaluation.md for where and in which layout), or set env.allow_hub=true to load "
        f"{source!r} from the Hugging Face Hub."
    )


def _iter_rows(dataset, columns: list[str], batch_size: int = 4096):
    """Rows as dicts, converted from Arrow a batch at a time (~8x faster than row by row)."""
    for batch in dataset.iter(batch_size=batch_size):
        values = [batch[column] for column in columns]
        for row_values in zip(*values):
            yield dict(zip(columns, row_values))


def load_math_records(
    source: str | Path,
    split: str | None = None,
    prompt_key: str | None = None,
    answer_key: str | None = None,
    limit: int | None = None,
    *,
    id_key: str | None = None,
    name: str | None = None,
    year: int | None = None,
    prompt_template: str | None = None,
    strip_instruction: bool = False,
    dedupe: bool = True,
    allow_hub: bool = False,
    cache_dir: str | None = None,
) -> list[dict[str, Any]]:
    """Load math problems as task records ``{"id", "prompt", "question", "answer", "source", "year"?}``.

    Args:
        source: a local ``.parquet`` / ``.jsonl`` / ``.json`` / ``.csv`` file, a local dataset directory,
            or (with ``allow_hub``) a Hub dataset name. See the module docstring for layouts.
        split: split to read from a directory or Hub dataset (default ``"train"``); ignored for a file.
        prompt_key, answer_key, id_key: column names (dotted for struct fields); None = auto-detect.
        limit: keep at most this many records (the first ones, after de-duplication).
        name: the records' ``source`` (default: :func:`eval_set_name` of ``source``); ids default to
            ``f"{name}-{row}"``.
        year: year for every record when the data has no ``year`` column (default: parsed from ``name``).
        prompt_template: ``prompt = prompt_template.replace("{question}", question)`` (other braces, e.g.
            ``\\boxed{}``, stay as they are); None keeps the question.
        strip_instruction: remove DAPO-Math-17K's instruction wrapper from the question.
        dedupe: drop rows whose ``(question, answer)`` was already seen.
        allow_hub: try the Hugging Face Hub when ``source`` is not a local path.
        cache_dir: ``datasets`` cache directory (default: ``~/.cache/huggingface/datasets``).

    Raises:
        MathDataError: missing file, unreadable file, missing columns (the message lists the columns found),
            or a row without prompt / answer.
    """
    source = str(source)
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0 or None, got {limit}")
    if prompt_template is not None and "{question}" not in prompt_template:
        raise ValueError(f"prompt_template must contain '{{question}}', got {prompt_template!r}")
    dataset = _load_dataset(source, split, allow_hub, cache_dir)
    set_name = name or eval_set_name(source)
    available = _available_fields(dataset.features)
    prompt_field = _resolve_field(prompt_key, PROMPT_CANDIDATES, available, "prompt", source, required=True)
    answer_field = _resolve_field(answer_key, ANSWER_CANDIDATES, available, "answer", source, required=True)
    id_field = _resolve_field(id_key, ID_CANDIDATES, available, "id", source, required=False)
    year_field = _resolve_field(None, YEAR_CANDIDATES, available, "year", source, required=False)
    default_year = year if year is not None else _year_from_name(set_name)
    # read only the needed columns: the DAPO file has 1.79 M rows of which we may use a few
    columns = sorted({f.partition(".")[0] for f in (prompt_field, answer_field, id_field, year_field) if f})
    dataset = dataset.select_columns(columns)
    records: list[dict[str, Any]] = []
    seen_raw: set[tuple[str, str]] = set()  # (prompt text, answer) as stored: repeats skip all other work
    seen_pairs: set[tuple[str, str]] = set()  # (question, answer) after normalisation
    seen_ids: set[str] = set()
    duplicates = 0
    for row_index, row in enumerate(_iter_rows(dataset, columns)):
        if limit is not None and len(records) >= limit:
            break
        where = f"{source} row {row_index}"
        text = _prompt_text(_get(row, prompt_field), prompt_field, where)
        raw_answer = _get(row, answer_field)
        if dedupe:
            raw_key = (text, repr(raw_answer))
            if raw_key in seen_raw:
                duplicates += 1
                continue
            seen_raw.add(raw_key)
        question = strip_dapo_instruction(text) if strip_instruction else text
        answer = _answer_text(raw_answer, answer_field, where)
        if dedupe:
            if (question, answer) in seen_pairs:
                duplicates += 1
                continue
            seen_pairs.add((question, answer))
        raw_id = _get(row, id_field) if id_field else None
        task_id = str(raw_id) if raw_id is not None and str(raw_id).strip() else f"{set_name}-{row_index}"
        if task_id in seen_ids:
            task_id = f"{task_id}#{row_index}"
        seen_ids.add(task_id)
        record: dict[str, Any] = {
            "id": task_id,
            "prompt": prompt_template.replace("{question}", question) if prompt_template else question,
            "question": question,
            "answer": answer,
            "source": set_name,
        }
        row_year = _get(row, year_field) if year_field else None
        if row_year is not None and str(row_year).strip().isdigit():
            record["year"] = int(str(row_year).strip())
        elif default_year is not None:
            record["year"] = default_year
        records.append(record)
    if duplicates:
        logger.info("%s: dropped %d duplicate (question, answer) rows", source, duplicates)
    if not records and (limit is None or limit > 0):
        raise MathDataError(f"{source}: no records (the data is empty)")
    return records


# --------------------------------------------------------------------------------------------------
# Config entry points (conf/env/math.yaml, conf/env/retool.yaml)
# --------------------------------------------------------------------------------------------------


def _loader_kwargs(env_cfg: Any) -> dict[str, Any]:
    """Loader options shared by training and evaluation data in an env config."""
    return {
        "prompt_key": _cfg_get(env_cfg, "prompt_key"),
        "answer_key": _cfg_get(env_cfg, "answer_key"),
        "id_key": _cfg_get(env_cfg, "id_key"),
        "prompt_template": _cfg_get(env_cfg, "prompt_template"),
        "strip_instruction": bool(_cfg_get(env_cfg, "strip_dapo_instruction", False)),
        "dedupe": bool(_cfg_get(env_cfg, "dedupe", True)),
        "allow_hub": bool(_cfg_get(env_cfg, "allow_hub", False)),
        "cache_dir": _cfg_get(env_cfg, "cache_dir"),
    }


def make_math_tasks(env_cfg: Any, seed: int = 0) -> list[dict[str, Any]]:
    """Training task records for ``env=math`` (and ``env=retool`` with a data file): the records of
    ``env_cfg.train_data`` (split ``train_split``), the first ``num_tasks`` of them (null = all).

    ``seed`` is unused (the prompt stream shuffles with the run seed); it keeps the signature of the other
    task makers. Each record also gets ``"env": env_cfg.name``.
    """
    del seed
    train_data = _cfg_get(env_cfg, "train_data")
    if not train_data:
        raise MathDataError(
            f"env {_cfg_get(env_cfg, 'name', '?')!r} needs env.train_data: the path of the training prompts "
            "(e.g. the DAPO-Math-17K parquet; see docs/evaluation.md)"
        )
    records = load_math_records(
        str(train_data), split=_cfg_get(env_cfg, "train_split"), limit=_cfg_get(env_cfg, "num_tasks"),
        **_loader_kwargs(env_cfg),
    )
    env_name = _cfg_get(env_cfg, "name", "math")
    for record in records:
        record["env"] = env_name
    return records


def load_eval_set(spec: Any, env_cfg: Any = None, limit: int | None = None) -> tuple[str, list[dict[str, Any]]]:
    """``(name, records)`` of one evaluation set.

    ``spec`` is a path / Hub name, or a mapping ``{path, name?, year?, split?, prompt_key?, answer_key?,
    id_key?}`` whose keys override the env config's loader options (``prompt_template``,
    ``strip_dapo_instruction``, ``allow_hub``, ...).
    """
    options = _loader_kwargs(env_cfg)
    if isinstance(spec, (str, Path)):
        path, extra = str(spec), {}
    elif isinstance(spec, Mapping) or hasattr(spec, "items"):
        extra = {str(k): v for k, v in spec.items()}
        path = extra.pop("path", None)
        if not path:
            raise MathDataError(f"eval set {dict(extra)!r} has no 'path'")
        path = str(path)
    else:
        raise MathDataError(f"eval set must be a path or a mapping with 'path', got {spec!r}")
    known = set(options) | {"name", "year", "split", "strip_dapo_instruction"}
    unknown = set(extra) - known
    if unknown:
        raise MathDataError(f"eval set {path!r}: unknown keys {sorted(unknown)}; valid: {sorted(known)}")
    if "strip_dapo_instruction" in extra:
        extra["strip_instruction"] = bool(extra.pop("strip_dapo_instruction"))
    options.update({k: v for k, v in extra.items() if v is not None})
    if path in PACKAGED_EVAL_SETS:
        name = options.pop("name", None) or path
        return name, PACKAGED_EVAL_SETS[path](name=name, limit=limit, prompt_template=options.get("prompt_template"))
    name = options.pop("name", None) or eval_set_name(path)
    records = load_math_records(path, limit=limit, name=name, **options)
    return name, records


_INTEGER_ANSWER = re.compile(r"-?\d+")


def champ_integer_records(name: str = "champ", limit: int | None = None,
                          prompt_template: str | None = None) -> list[dict[str, Any]]:
    """CHAMP's competition problems whose final answer is a plain integer, as math task records.

    CHAMP (PyPI ``champ-dataset`` 1.0.0, MIT; "Concept and Hint-Augmented Math Problems") ships 270 problems
    (number theory, inequalities, polynomials, sequences, combinatorics) with final answers in its package data;
    79 of the answers are integers (``-?\\d+``), which the math grader checks exactly. The others (formulas in
    ``n``, "C(10, 5), or equivalently 252") are left out. Order: the package's (identifier order).
    """
    try:
        import champ_dataset
    except ImportError as err:
        raise MathDataError("eval set 'champ' needs the champ-dataset package: pip install champ-dataset==1.0.0 "
                            "(a pyproject.toml dependency: make install)") from err
    if prompt_template is not None and "{question}" not in prompt_template:
        raise ValueError(f"prompt_template must contain '{{question}}', got {prompt_template!r}")
    records: list[dict[str, Any]] = []
    for problem in champ_dataset.load("v0").problems.values():
        answer = (problem.answer or "").strip()
        if not _INTEGER_ANSWER.fullmatch(answer):
            continue
        question = problem.text.strip()
        records.append({"id": f"{name}-{problem.identifier}", "question": question, "answer": answer,
                        "prompt": prompt_template.replace("{question}", question) if prompt_template else question,
                        "source": name, "category": problem.category})
        if limit is not None and len(records) >= limit:
            break
    return records


#: eval sets that ship inside a Python package: their name stands for the path in eval_sets
PACKAGED_EVAL_SETS = {"champ": champ_integer_records}
