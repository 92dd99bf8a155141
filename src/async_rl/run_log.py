"""``<run dir>/train.log`` holds what the run showed on stdout, every warning, and readable logger names.

Hydra opens ``train.log`` for the logging module only; the trainer's progress lines, resume notes, KL-guard
warnings and summary are printed. :func:`run_log` (used by ``async_rl.train`` around a CLI run):

- copies every line written to ``sys.stdout`` into ``train.log`` as well (the terminal sees the same as before;
  tqdm bars go to stderr and stay out of the file);
- routes Python ``warnings`` through logging (``py.warnings``), so they land in ``train.log`` too;
- names log records by module (``verl.workers.actor.dp_actor``), not by the file path that libraries such as
  verl pass to ``logging.getLogger(__file__)``.

Standard library only.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Iterator, Optional, TextIO


def module_name_of(name: str) -> str:
    """``/…/site-packages/verl/workers/actor.py`` -> ``verl.workers.actor``; other names unchanged."""
    if not name.endswith(".py") or os.sep not in name:
        return name
    parts = Path(name).with_suffix("").parts
    for anchor in ("site-packages", "dist-packages", "src"):
        if anchor in parts:
            parts = parts[len(parts) - 1 - parts[::-1].index(anchor) + 1:]
            break
    else:
        parts = parts[-2:]
    if parts and parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or name


class ModuleNames(logging.Filter):
    """A handler filter that rewrites path-shaped logger names (:func:`module_name_of`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.name = module_name_of(record.name)
        return True


class _Tee:
    """``sys.stdout`` that also appends each line to a file, stamped with the time."""

    def __init__(self, stream: TextIO, log: TextIO):
        self.stream, self.log, self._partial = stream, log, ""

    def write(self, text: str) -> int:
        written = self.stream.write(text)
        self._partial += text
        *lines, self._partial = self._partial.split("\n")
        stamp = time.strftime("%Y-%m-%d %H:%M:%S")
        for line in lines:
            if line.strip():
                self.log.write(f"[{stamp}][stdout] {line}\n")
        if lines:
            self.log.flush()
        return written

    def flush(self) -> None:
        self.stream.flush()
        self.log.flush()

    def __getattr__(self, name):  # isatty, fileno, encoding ...: the terminal's
        return getattr(self.stream, name)


def log_file_of_root() -> Optional[Path]:
    """The file the root logger writes to (Hydra's ``train.log`` in a CLI run); None outside Hydra."""
    for handler in reversed(logging.getLogger().handlers):  # the newest: this run's
        if isinstance(handler, logging.FileHandler):
            return Path(handler.baseFilename)
    return None


@contextlib.contextmanager
def run_log() -> Iterator[Optional[Path]]:
    """Within the block: stdout copied to the root logger's file, warnings logged, module logger names. Yields
    that file (None, and only the logging parts apply, when no handler writes a file)."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, ModuleNames) for f in handler.filters):
            handler.addFilter(ModuleNames())
    if warnings.showwarning.__module__ != "logging":  # (re)install: something may have restored the original
        logging.captureWarnings(False)
        logging.captureWarnings(True)
    path = log_file_of_root()
    if path is None:
        yield None
        return
    original = sys.stdout
    with open(path, "a", encoding="utf-8") as log:
        sys.stdout = _Tee(original, log)
        try:
            yield path
        finally:
            sys.stdout.flush()
            sys.stdout = original


def append_line(line: str) -> None:
    """Add one line (e.g. the CLI's final ``interrupted ...`` or ``error: ...`` line, written to stderr) to the
    root logger's file, when there is one."""
    path = log_file_of_root()
    if path is not None:
        with open(path, "a", encoding="utf-8") as log:
            log.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}][stderr] {line}\n")


def log_only(line: str) -> None:
    """Add a line to ``train.log`` without showing it (a progress line while the terminal draws a bar); nothing
    outside a :func:`run_log` block."""
    stdout = sys.stdout
    if isinstance(stdout, _Tee):
        stdout.log.write(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}][stdout] {line}\n")
        stdout.log.flush()
