"""Shared pieces of every benchmark: machine info with the git commit and dirty flag, result files, threads,
quiet libraries, progress bars and tables. It imports no ``async_rl`` code, so a script that uses only these
pieces measures only what it imports itself (``result_sources.py`` derives a result's code from its script's
import closure); the training helpers are in ``_training.py``.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


def set_threads() -> None:
    """One intra-op thread: fastest for the tiny model on a shared machine, and comparable across runs."""
    torch.set_num_threads(1)


def quiet_libraries() -> None:
    """Silence transformers' per-load progress bars (one per model load would drown the benchmark's output)."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_logging.set_verbosity_error()
    except Exception:  # noqa: BLE001 - cosmetic only
        pass
    try:
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()
    except Exception:  # noqa: BLE001
        pass


def progress(total: int, desc: str):
    """A tqdm bar on a terminal; silent (disabled) when stderr is not a TTY (CI logs, redirected runs)."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="step", dynamic_ncols=True, leave=False,
                disable=not sys.stderr.isatty())


def git_provenance() -> dict[str, Any]:
    """``git_commit`` (short hash of HEAD) and ``git_dirty`` (tracked files other than benchmarks/results/ differ
    from HEAD, so the result may come from code no commit holds; a result file rewritten in place is output, not
    code); both None outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD") or None
        dirty = bool(git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)benchmarks/results"))
    except Exception:  # noqa: BLE001 - not a checkout, or no git: provenance unknown
        return {"git_commit": None, "git_dirty": None}
    return {"git_commit": commit, "git_dirty": dirty}


def machine_info() -> dict[str, Any]:
    info: dict[str, Any] = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.is_available(),
        "device": "cpu",
    }
    try:
        import verl

        info["verl"] = getattr(verl, "__version__", "unknown")
    except Exception:  # noqa: BLE001 - informational only
        info["verl"] = None
    info.update(git_provenance())
    try:
        load = os.getloadavg()
        info["load_avg_1m_at_start"] = round(load[0], 2)
    except OSError:
        pass
    return info


def window_mean(values: list[float], end_frac: float, width_frac: float = 0.1) -> float:
    """Mean of ``values`` over the window of ``width_frac`` of the run ending at ``end_frac`` of the run."""
    n = len(values)
    if n == 0:
        return float("nan")
    end = max(1, round(end_frac * n))
    width = max(1, round(width_frac * n))
    window = values[max(0, end - width):end]
    return sum(window) / len(window)


def result_stem(name: str, quick: bool) -> str:
    """File stem under results/: ``--quick`` runs get their own files and never overwrite a full run's."""
    return f"{name}_quick" if quick else name


def save_json(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    if isinstance(payload.get("machine"), dict):
        try:  # the machine is shared: the load next to the timings says how much to trust them
            payload["machine"]["load_avg_1m_at_end"] = round(os.getloadavg()[0], 2)
        except OSError:
            pass
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=_json_default) + "\n")
    return path


def _json_default(obj):
    if isinstance(obj, Path):
        return str(obj)
    if hasattr(obj, "item"):
        return obj.item()
    return str(obj)


def fmt(value: Any, digits: int = 3) -> str:
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def print_table(rows: list[list[Any]], header: list[str]) -> None:
    cells = [[fmt(c) for c in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) for i, h in enumerate(header)]
    print("  ".join(h.ljust(w) for h, w in zip(header, widths)))
    print("  ".join("-" * w for w in widths))
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)))
