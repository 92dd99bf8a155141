"""Run logging through verl's ``Tracking``: a local JSONL always, wandb (offline unless the user sets
``WANDB_MODE=online``), and a summary. Everything lands under ``outputs/<run_name>/``.

``metrics.jsonl`` holds one row per training step, each step exactly once. A fresh run starts it empty; a
resumed run (``resume_step=s``) keeps the rows of steps 1..s, drops the rows after s (the resumed run
redoes those steps) and appends from step s + 1. The file is only rewritten once the resume has succeeded
(the caller creates the logger after loading the checkpoint), and it is rewritten atomically.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Optional


def _clean(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for key, value in metrics.items():
        try:
            value = float(value)
        except (TypeError, ValueError):
            continue
        if not math.isnan(value):
            out[key] = value
    return out


def _row(clean: dict[str, float], step: int) -> dict[str, Any]:
    return {"step": step, **clean}


def _write_atomically(path: Path, text: str) -> None:
    """Write to ``<path>.tmp``, flush to disk, rename over ``path``: a kill leaves the old or the new file."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def rows_up_to(metrics_path: str | os.PathLike, last_step: int,
               history: list[dict[str, Any]] = ()) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` for steps 1..``last_step``, each step once (its first row), in step
    order; a step the file lacks is taken from ``history`` (metrics dicts with ``trainer/step``). Lines
    that do not parse (a row torn by a kill) and rows after ``last_step`` are left out."""
    by_step: dict[int, dict[str, Any]] = {}
    path = Path(metrics_path)
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            step = row.get("step") if isinstance(row, dict) else None
            if isinstance(step, int) and not isinstance(step, bool) and 1 <= step <= last_step:
                by_step.setdefault(step, row)
    for metrics in history:
        step = metrics.get("trainer/step")
        try:
            step = int(step)
        except (TypeError, ValueError):
            continue
        if 1 <= step <= last_step and step not in by_step:
            by_step[step] = _row(_clean(metrics), step)
    return [by_step[step] for step in sorted(by_step)]


class RunLogger:
    """Logs one metrics dict per training step to ``metrics.jsonl`` (and wandb when enabled)."""

    def __init__(self, run_dir: str | os.PathLike, project: str, run_name: str, config: dict,
                 use_wandb: bool = True, resume_step: Optional[int] = None,
                 history: Optional[list[dict[str, Any]]] = None):
        """``resume_step``: the step of the checkpoint the run resumed from (None: a fresh run, the file
        starts empty). ``history``: the checkpoint's metrics rows (``trainer/step`` in each), used to fill
        steps up to ``resume_step`` that the file lacks (e.g. it was deleted)."""
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.metrics_path = self.run_dir / "metrics.jsonl"
        rows = [] if resume_step is None else rows_up_to(self.metrics_path, resume_step, history or [])
        _write_atomically(self.metrics_path, "".join(json.dumps(row) + "\n" for row in rows))
        _write_atomically(self.run_dir / "config.json", json.dumps(config, indent=2, default=str) + "\n")
        self._file = self.metrics_path.open("a")
        self.tracking = None
        if use_wandb:
            os.environ.setdefault("WANDB_MODE", "offline")  # no network here; the user opts in to online
            os.environ.setdefault("WANDB_SILENT", "true")
            os.environ["WANDB_DIR"] = str(self.run_dir)
            import wandb
            from verl.utils.tracking import Tracking

            # wandb keeps process-wide settings from its first run: reset them so this run's dir is used
            teardown = getattr(wandb, "teardown", None)
            if callable(teardown):
                teardown()

            self.tracking = Tracking(project_name=project, experiment_name=run_name, default_backend=["wandb"],
                                     config={"trainer": {}, **config})
            wandb = self.tracking.logger["wandb"]
            # one x axis for every panel; prefixes (actor/, critic/, async/, ...) become wandb sections
            wandb.define_metric("trainer/step")
            wandb.define_metric("*", step_metric="trainer/step")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        clean = _clean(metrics)
        self._file.write(json.dumps(_row(clean, step)) + "\n")
        self._file.flush()
        if self.tracking is not None:
            self.tracking.log(clean, step=step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        if self.tracking is not None:
            run = self.tracking.logger["wandb"].run
            if run is not None:
                for key, value in summary.items():
                    run.summary[key] = value

    def log_table(self, key: str, columns: list[str], rows: list[list[Any]], step: Optional[int] = None) -> None:
        """A wandb Table (e.g. ``li2sao/switch``, ``eval/pass_at_k``); also kept as ``<key>.json`` locally."""
        (self.run_dir / (key.replace("/", "_") + ".json")).write_text(
            json.dumps({"columns": columns, "rows": rows}, indent=2) + "\n")
        if self.tracking is not None:
            wandb = self.tracking.logger["wandb"]
            table = wandb.Table(columns=columns, data=rows)
            payload = {key: table}
            if len(columns) == 2 and all(isinstance(r[1], (int, float)) for r in rows):
                payload[key + "_plot"] = wandb.plot.bar(table, columns[0], columns[1], title=key)
            wandb.log(payload, step=step)

    def wandb_dir(self) -> Optional[str]:
        if self.tracking is None:
            return None
        run = self.tracking.logger["wandb"].run
        return getattr(run, "dir", None) if run is not None else None

    def close(self, failed: bool = False) -> None:
        if not self._file.closed:
            self._file.close()
        if self.tracking is not None:
            self.tracking.finish(exit_code=1 if failed else 0)
            self.tracking = None
