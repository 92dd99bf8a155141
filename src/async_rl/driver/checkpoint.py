"""Checkpoint files of the driver: atomic writes with a SHA-256 checksum, newest-good-first loading with
fallback, pruning to the last ``keep_last``, cleanup of stale temporary files, and the checksummed manifest
of sharded model state (``trainer.workers=ray``: every train rank writes its own shard).

Entry points: :func:`write_checkpoint`, :func:`read_checkpoint`, :func:`load_newest_good`,
:func:`resume_checkpoint`, :func:`prune_checkpoints`, :func:`remove_stale_tmp`.

Details: docs/driver.md (Checkpoint and resume: the file layout, write order and damaged checkpoints;
Checkpoints with ``trainer.workers=ray``: the shard manifest and its one commit point).
"""

from __future__ import annotations

import hashlib
import os
import pickle
import re
import shutil
import zipfile
from pathlib import Path
from typing import Any, Callable, Optional

import torch

CHECKPOINT_NAME = re.compile(r"^step_(\d+)\.pt$")
TMP_SUFFIX = ".tmp"
CHECKSUM_SUFFIX = ".sha256"
CORRUPT_SUFFIX = ".corrupt"
SHARDS_SUFFIX = ".shards"  # step_N.pt.shards/: the sharded model state of step_N.pt
SHARDS_NAME = re.compile(r"^step_(\d+)\.pt\.shards$")


class CheckpointError(RuntimeError):
    """No usable checkpoint, or one that does not fit this run's config."""


def checkpoint_path(directory: str | os.PathLike, step: int) -> Path:
    return Path(directory) / f"step_{step:06d}.pt"


def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """``(step, path)`` of every ``step_N.pt`` in ``directory``, oldest first (empty if there is none)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = CHECKPOINT_NAME.match(path.name)
        if match and path.is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def _fsync_file(path: Path) -> None:
    with open(path, "rb+") as handle:
        os.fsync(handle.fileno())


def _fsync_dir(directory: Path) -> None:
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # some file systems do not open directories; the renames are still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def sha256_of(path: str | os.PathLike, chunk_bytes: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in 4 MiB chunks (checkpoints of real models are tens of GB)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while True:
            chunk = handle.read(chunk_bytes)
            if not chunk:
                return digest.hexdigest()
            digest.update(chunk)


def _write_text_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + TMP_SUFFIX)
    with open(tmp, "w") as handle:
        handle.write(text)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(tmp, path)


def shards_path(checkpoint: str | os.PathLike) -> Path:
    """Where the sharded model state of the driver-state file ``checkpoint`` lies (``step_N.pt.shards/``)."""
    checkpoint = Path(checkpoint)
    return checkpoint.with_name(checkpoint.name + SHARDS_SUFFIX)


def shard_manifest(directory: str | os.PathLike) -> dict[str, str]:
    """``{relative path: SHA-256}`` of every file under ``directory`` (sorted, ``/``-separated)."""
    directory = Path(directory)
    return {path.relative_to(directory).as_posix(): sha256_of(path)
            for path in sorted(directory.rglob("*")) if path.is_file()}


def _fsync_tree(directory: Path) -> None:
    for path in sorted(directory.rglob("*")):
        if path.is_file():
            _fsync_file(path)
    for sub in sorted({p.parent for p in directory.rglob("*")} | {directory}):
        _fsync_dir(sub)


def write_checkpoint(state: dict, directory: str | os.PathLike, step: int,
                     write_shards: Optional[Callable[[Path], Any]] = None) -> Path:
    """Save ``state`` as ``step_<step>.pt`` with its checksum and point ``latest`` at it (see module doc).

    ``write_shards(tmp_dir)``, when given, writes the sharded model state into an empty directory (every
    train rank its shard); its files' SHA-256s are stored in the saved state as ``state["shards"]``.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    remove_stale_tmp(directory)
    path = checkpoint_path(directory, step)
    tmp = path.with_name(path.name + TMP_SUFFIX)
    shards = shards_path(path)
    shards_tmp = shards.with_name(shards.name + TMP_SUFFIX)
    if write_shards is not None:
        shards_tmp.mkdir()
        write_shards(shards_tmp)
        _fsync_tree(shards_tmp)
        state = {**state, "shards": {"dir": shards.name, "files": shard_manifest(shards_tmp)}}
    torch.save(state, tmp)
    _fsync_file(tmp)
    _write_text_atomically(path.with_name(path.name + CHECKSUM_SUFFIX), f"{sha256_of(tmp)}  {path.name}\n")
    if write_shards is not None:
        if shards.exists():  # left by a run resumed from an earlier explicit path: replaced with its .pt
            shutil.rmtree(shards)
        os.replace(shards_tmp, shards)
    os.replace(tmp, path)  # the commit point
    _write_text_atomically(directory / "latest", path.name + "\n")
    _fsync_dir(directory)
    return path


def remove_stale_tmp(directory: str | os.PathLike) -> list[Path]:
    """Delete the ``*.tmp`` leftovers (files, and shard directories) of writes that a killed process never
    finished; returns them."""
    directory = Path(directory)
    removed = []
    if directory.is_dir():
        for path in directory.iterdir():
            if not path.name.endswith(TMP_SUFFIX):
                continue
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
            removed.append(path)
    return removed


def prune_checkpoints(directory: str | os.PathLike, current_step: int, keep_last: int) -> list[Path]:
    """Keep the ``keep_last`` newest checkpoints up to ``current_step`` and delete older ones (with their
    checksums) and checksums whose checkpoint is gone. Checkpoints past ``current_step`` (left by a run
    resumed from an earlier explicit path) are left alone: the run overwrites them when it gets there."""
    directory = Path(directory)
    up_to_now = [(step, path) for step, path in list_checkpoints(directory) if step <= current_step]
    removed = []
    for _, path in up_to_now[:-keep_last] if keep_last > 0 else up_to_now:
        path.unlink(missing_ok=True)
        path.with_name(path.name + CHECKSUM_SUFFIX).unlink(missing_ok=True)
        shutil.rmtree(shards_path(path), ignore_errors=True)
        removed.append(path)
    for checksum in directory.glob(f"step_*.pt{CHECKSUM_SUFFIX}"):
        if not checksum.with_name(checksum.name[: -len(CHECKSUM_SUFFIX)]).exists():
            checksum.unlink(missing_ok=True)
    for shards in directory.glob(f"step_*.pt{SHARDS_SUFFIX}"):  # renamed in by a save killed before its .pt
        if SHARDS_NAME.match(shards.name) and not shards.with_name(shards.name[: -len(SHARDS_SUFFIX)]).exists():
            shutil.rmtree(shards, ignore_errors=True)
    return removed


def read_checkpoint(path: str | os.PathLike) -> tuple[Optional[dict], Optional[str]]:
    """``(state, None)`` for a good checkpoint, ``(None, why)`` for a missing, truncated or corrupt one.

    Checks, in order: the file exists; its SHA-256 matches ``<path>.sha256`` when that file exists
    (checkpoints written before checksums existed have none and get the load check only); ``torch.load``
    succeeds; the result is a driver state dict; with sharded model state, every shard file of its manifest
    is there with its SHA-256 (``state["shards"]["path"]`` is then set to the shard directory).
    """
    path = Path(path)
    if not path.is_file():
        return None, "file not found"
    checksum = path.with_name(path.name + CHECKSUM_SUFFIX)
    if checksum.is_file():
        expected = checksum.read_text().split()
        if not expected:
            return None, f"empty checksum file {checksum.name}"
        actual = sha256_of(path)
        if actual != expected[0]:
            return None, (f"checksum mismatch: {path.stat().st_size} bytes with SHA-256 {actual[:12]}..., "
                          f"{checksum.name} says {expected[0][:12]}... (truncated or corrupt)")
    try:
        state = torch.load(path, weights_only=False)
    except (RuntimeError, EOFError, OSError, ValueError, pickle.UnpicklingError, zipfile.BadZipFile,
            AttributeError, ImportError, IndexError, KeyError, TypeError) as err:
        # what a truncated or damaged zip/pickle raises differs by where the damage is
        message = str(err).splitlines()[0] if str(err) else ""
        return None, f"torch.load failed ({type(err).__name__}: {message[:200]})"
    if not isinstance(state, dict) or "format" not in state:
        return None, "not a driver checkpoint (no 'format' key)"
    if state.get("shards") is not None:
        problem = _check_shards(path, state["shards"])
        if problem is not None:
            return None, problem
        state["shards"]["path"] = str(shards_path(path))
    return state, None


def _check_shards(path: Path, manifest: dict) -> Optional[str]:
    """Why the shard directory of ``path`` does not match its manifest, or None when it does."""
    shards = shards_path(path)
    if not shards.is_dir():
        return f"its shard directory {shards.name}/ is missing"
    expected = manifest.get("files") or {}
    if not expected:
        return "its shard manifest lists no file"
    missing = [name for name in expected if not (shards / name).is_file()]
    if missing:
        return f"shard files missing from {shards.name}/: {', '.join(missing[:4])}"
    for name, digest in expected.items():
        if sha256_of(shards / name) != digest:
            return f"shard {shards.name}/{name}: checksum mismatch (truncated or corrupt)"
    return None


def load_newest_good(directory: str | os.PathLike, load: Callable[[dict], Any],
                     log: Callable[[str], None] = print) -> Optional[Path]:
    """Load (through ``load``) the newest checkpoint of ``directory`` that reads back intact, skipping
    damaged ones with a printed message; returns its path, or None when the directory holds no checkpoint.

    Raises :class:`CheckpointError` when every checkpoint is damaged. Nothing on disk is changed unless a
    checkpoint was loaded: then stale ``*.tmp`` files are removed and the damaged newer checkpoints are
    renamed ``*.pt.corrupt`` (kept for inspection, never loaded or pruned).
    """
    directory = Path(directory)
    candidates = list(reversed(list_checkpoints(directory)))
    if not candidates:
        return None
    damaged: list[tuple[Path, str]] = []
    for _, path in candidates:
        state, problem = read_checkpoint(path)
        if problem is not None:
            damaged.append((path, problem))
            log(f"checkpoint {path} is unusable: {problem}; trying the previous one")
            continue
        load(state)
        if damaged:
            log(f"resumed from the previous good checkpoint {path.name}; "
                f"set aside as *.corrupt: {', '.join(p.name for p, _ in damaged)}")
        for bad, _ in damaged:
            os.replace(bad, bad.with_name(bad.name + CORRUPT_SUFFIX))
            bad.with_name(bad.name + CHECKSUM_SUFFIX).unlink(missing_ok=True)
            if shards_path(bad).is_dir():  # kept beside it: step_N.pt.corrupt.shards/
                os.replace(shards_path(bad), bad.with_name(bad.name + CORRUPT_SUFFIX + SHARDS_SUFFIX))
        if damaged:
            _write_text_atomically(directory / "latest", path.name + "\n")
        remove_stale_tmp(directory)
        return path
    raise CheckpointError(
        f"no usable checkpoint in {directory}: " + "; ".join(f"{p.name}: {why}" for p, why in damaged)
        + ". Nothing was changed; move the directory away (or choose another trainer.run_name) to start over.")


def resume_checkpoint(load_state: Callable[[dict], None], directory: Optional[str | os.PathLike],
                      path: Optional[str | os.PathLike] = None) -> Optional[Path]:
    """The one resume rule of both schedulers: load ``path``, or else the newest intact checkpoint of
    ``directory`` (falling back past damaged ones with a printed message); the checkpoint read, or None
    when there is none. A state that ``load_state`` rejects (another config) raises :class:`CheckpointError`
    naming the checkpoint; a failed resume changes no file."""

    def checked(state: dict, where: Optional[Path]) -> None:
        try:
            load_state(state)
        except (KeyError, ValueError, RuntimeError, TypeError) as err:
            name = f"checkpoint {where}" if where else f"the newest intact checkpoint in {directory}"
            raise CheckpointError(f"{name} does not fit this run ({type(err).__name__}: {err}); resume with the "
                                  "config it was saved with (algorithm, model, batch sizes)") from err

    if path is not None:
        state, problem = read_checkpoint(path)
        if problem is not None:
            raise CheckpointError(f"checkpoint {path} is unusable: {problem}")
        checked(state, Path(path))
        return Path(path)
    if not directory:
        return None
    return load_newest_good(directory, lambda state: checked(state, None))
