"""One run per folder (issue 38, item 2): ``<trainer.output_dir>/<trainer.run_name>`` belongs to one run.

- :func:`check_run_dir`: a run refuses a folder that holds another run's outputs unless it resumes that run
  (``trainer.resume=true``, which needs a checkpoint there) or replaces it (``trainer.overwrite=true``: the old
  outputs are deleted before anything is written).
- :class:`RunLock`: ``<run dir>/.lock``, held with ``flock`` for the life of the process, so two live runs
  never share a folder. The kernel drops the lock when its process dies, so the lock of a killed run
  (SIGKILL, a crash, a lost node) is stale at once and the next run takes it over, saying whose it was.

Light: standard library only (the CLI checks the folder before torch loads).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import socket
import sys
import time
from pathlib import Path
from typing import Optional

from async_rl.validation import ConfigError

LOCK_NAME = ".lock"
#: Hydra's log of this process (created in the folder before the run's own code starts): not another run's output
HYDRA_LOG = "train.log"


def run_outputs(run_dir: Path) -> list[str]:
    """Names of what ``run_dir`` holds besides the lock and Hydra's log (an empty ``checkpoints/`` counts as nothing)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    names = []
    for entry in sorted(run_dir.iterdir()):
        if entry.name in (LOCK_NAME, HYDRA_LOG):
            continue
        if entry.is_dir() and not any(entry.iterdir()):
            continue
        names.append(entry.name + ("/" if entry.is_dir() else ""))
    return names


def has_checkpoint(run_dir: Path) -> bool:
    return any((Path(run_dir) / "checkpoints").glob("step_*.pt"))


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Raise :class:`ConfigError` (one line naming the fix) when this run may not use ``run_dir``."""
    if resume and overwrite:
        raise ConfigError("trainer.resume=true and trainer.overwrite=true: choose one (resume continues the run in "
                          f"{run_dir}, overwrite deletes its outputs and starts over)")
    outputs = run_outputs(run_dir)
    if not outputs or overwrite:
        return
    shown = ", ".join(outputs[:6]) + (", ..." if len(outputs) > 6 else "")
    if resume:
        if not has_checkpoint(run_dir):
            raise ConfigError(f"trainer.resume=true: {run_dir} holds no checkpoint to resume from (it holds {shown}); "
                              "set trainer.overwrite=true to replace that run, or choose another trainer.run_name")
        return
    raise ConfigError(f"{run_dir} holds the outputs of another run ({shown}); continue it with trainer.resume=true, "
                      "replace it with trainer.overwrite=true, or choose another trainer.run_name")


def clear_outputs(run_dir: Path) -> list[str]:
    """``trainer.overwrite=true``: delete what an earlier run left in ``run_dir`` (the lock stays; Hydra's log,
    which this process may already hold open, is emptied). Returns the names removed."""
    removed = run_outputs(run_dir)
    for name in removed:
        path = Path(run_dir) / name.rstrip("/")
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    log = Path(run_dir) / HYDRA_LOG
    if log.is_file():
        with open(log, "r+") as handle:
            handle.truncate(0)
    return removed


class RunLock:
    """``<run dir>/.lock`` held with ``flock`` by this process (see the module docstring)."""

    _held: dict[str, "RunLock"] = {}  # run dir -> the lock this process holds on it

    def __init__(self, run_dir: Path, fd: int, took_over: Optional[dict], created: list[Path]):
        self.run_dir = Path(run_dir)
        self.fd = fd
        self.took_over = took_over  # what the stale lock said (pid, host, started), or None
        self.created = created  # folders acquire() made, deepest first: removed again if the run left them empty

    @classmethod
    def held(cls, run_dir: Path) -> Optional["RunLock"]:
        return cls._held.get(str(Path(run_dir).resolve()))

    @classmethod
    def acquire(cls, run_dir: Path) -> "RunLock":
        """Take the folder's lock (creating the folder), or raise :class:`ConfigError` naming the live run that
        holds it. Idempotent within a process."""
        run_dir = Path(run_dir)
        held = cls.held(run_dir)
        if held is not None:
            return held
        created = [d for d in (run_dir, *run_dir.parents) if not d.exists()]
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_NAME
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            owner = _read_owner(fd)
            os.close(fd)
            for folder in created:
                try:
                    folder.rmdir()
                except OSError:
                    break
            who = (f"pid {owner.get('pid')} on {owner.get('host')}, started {owner.get('started')}" if owner
                   else "another process")
            raise ConfigError(f"{run_dir} is in use by another run ({who}); wait for it to end, or choose another "
                              "trainer.run_name") from None
        previous = _read_owner(fd)
        me = {"pid": os.getpid(), "host": socket.gethostname(),
              "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        lock = cls(run_dir, fd, previous or None, created)
        cls._held[str(run_dir.resolve())] = lock
        if previous:
            print(f"{run_dir}: took over the stale lock of pid {previous.get('pid')} on {previous.get('host')} "
                  f"(started {previous.get('started')}; that run is no longer running)", flush=True)
        return lock

    def release(self) -> None:
        """Give the folder back (the lock file goes; a later run finds no stale lock)."""
        if self.fd < 0:
            return
        try:
            (self.run_dir / LOCK_NAME).unlink(missing_ok=True)
        finally:
            os.close(self.fd)
            self.fd = -1
            self._held.pop(str(self.run_dir.resolve()), None)
        for folder in self.created:  # a run that stopped before writing anything leaves no empty folders
            try:
                folder.rmdir()
            except OSError:  # not empty (the run wrote there), or gone
                break


def _read_owner(fd: int) -> dict:
    try:
        text = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        owner = json.loads(text) if text else {}
        return owner if isinstance(owner, dict) else {}
    except (OSError, ValueError):
        return {"pid": "?", "host": "?", "started": "?"}


def model_identity(model_dir: str | os.PathLike) -> dict:
    """What an evaluation or a plot records about the model it is of: ``model_dir``, a ``fingerprint`` (SHA-256
    of ``config.json`` and the names and sizes of the weight files: an async_rl export's config.json carries its
    run, step and export time, so two exports never share one) and, for an async_rl export, ``run_name``,
    ``step`` and ``exported_at``. Standard library only."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    config = model_dir / "config.json"
    info: dict = {}
    if config.is_file():
        raw = config.read_bytes()
        digest.update(raw)
        try:
            info = json.loads(raw).get("async_rl") or {}
        except (ValueError, AttributeError):
            info = {}
    for weights in sorted(model_dir.glob("*.safetensors")) + sorted(model_dir.glob("*.bin")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    out = {"model_dir": str(model_dir), "fingerprint": digest.hexdigest()[:16]}
    out.update({key: info[key] for key in ("run_name", "step", "exported_at") if key in info})
    return out
