"""One cgroup per sandbox run: a memory limit for all its processes together, and a process cap.

Used by :class:`async_rl.sandbox.local.LocalSandbox`. Standard library only. A run's cgroup (v1 or v2) is
created below the trainer's own, its tmpfs pages count against its memory limit, and a controller is used
only if a probe cgroup could be created, limited and removed (:func:`probe`); :func:`remove_stale` removes
empty ones left by trainers that no longer exist.

Details: docs/tasks.md (Code sandbox: The run's cgroup).
"""

from __future__ import annotations

import itertools
import os
import signal
import threading
import time
from dataclasses import dataclass

__all__ = ["CgroupLayout", "RunCgroup", "probe", "remove_stale"]

_PREFIX = "async_rl_sandbox_"
_counter = itertools.count()
_counter_lock = threading.Lock()


@dataclass(frozen=True)
class CgroupLayout:
    """Where this process may create per-run cgroups.

    Attributes:
        memory_parent: directory under which a run's memory cgroup is created (None: no memory cgroup).
        pids_parent: same for the pids controller (v1: a separate hierarchy; v2: same as memory_parent).
        version: 1 or 2.
        cpu_parent: same for the cpu controller. No limit is written: being its own cgroup with the
            default weight makes each run *one* scheduling entity, so a run with 60 spinning processes
            (a fork bomb at its cap) gets no more CPU than a neighbour run with one.
    """

    memory_parent: str | None
    pids_parent: str | None
    version: int
    cpu_parent: str | None = None


def _cgroup_mounts() -> tuple[dict[str, str], str | None]:
    """``({v1 controller: mount point}, v2 mount point or None)`` from ``/proc/self/mountinfo``."""
    v1: dict[str, str] = {}
    v2 = None
    with open("/proc/self/mountinfo", encoding="utf-8") as handle:
        for line in handle:
            left, _, right = line.partition(" - ")
            fields, tail = left.split(), right.split()
            if len(fields) < 5 or len(tail) < 3:
                continue
            mount_point, fstype, super_options = fields[4], tail[0], tail[2].split(",")
            if fstype == "cgroup2" and v2 is None:
                v2 = mount_point
            elif fstype == "cgroup":
                for controller in ("memory", "pids", "cpu"):
                    if controller in super_options and controller not in v1:
                        v1[controller] = mount_point
    return v1, v2


def _own_paths() -> dict[str, str]:
    """``{controller or "": path}`` of this process (``""`` is the v2 unified hierarchy)."""
    paths: dict[str, str] = {}
    with open("/proc/self/cgroup", encoding="utf-8") as handle:
        for line in handle:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) != 3:
                continue
            for controller in parts[1].split(","):
                paths[controller] = parts[2]
    return paths


def _join(mount_point: str, path: str) -> str:
    return os.path.join(mount_point, path.lstrip("/"))


def _write(path: str, value: str) -> None:
    with open(path, "w", encoding="ascii") as handle:
        handle.write(value)


def _candidate_layout() -> tuple[CgroupLayout | None, list[str]]:
    """The directories we would use, before checking that they work."""
    reasons: list[str] = []
    v1_mounts, v2_mount = _cgroup_mounts()
    own = _own_paths()
    parents = {
        controller: _join(v1_mounts[controller], own[controller])
        for controller in ("memory", "pids", "cpu")
        if controller in v1_mounts and controller in own
    }
    if parents.get("memory") or parents.get("pids"):
        return CgroupLayout(parents.get("memory"), parents.get("pids"), 1, parents.get("cpu")), reasons
    if v2_mount and "" in own:
        parent = _join(v2_mount, own[""])
        try:
            with open(os.path.join(parent, "cgroup.controllers"), encoding="ascii") as handle:
                available = handle.read().split()
        except OSError as exc:
            return None, [f"cgroup v2 at {parent} unreadable: {exc}"]
        wanted = [c for c in ("memory", "pids") if c in available]
        if not wanted:
            return None, [f"cgroup v2 at {parent} offers neither memory nor pids controllers ({available})"]
        try:
            with open(os.path.join(parent, "cgroup.subtree_control"), encoding="ascii") as handle:
                enabled = handle.read().split()
            missing = [c for c in wanted if c not in enabled]
            if missing:
                _write(os.path.join(parent, "cgroup.subtree_control"), " ".join("+" + c for c in missing))
        except OSError as exc:
            return None, [
                f"cgroup v2: cannot enable {'+'.join(wanted)} for children of {parent} ({exc}; v2 refuses this "
                "while the trainer's own cgroup holds processes). Fix: start the trainer in a cgroup whose "
                "processes live in a leaf child, or mount a writable cgroup v1 memory hierarchy"
            ]
        cpu = False
        if "cpu" in available:  # optional: without it runs only lose the fair CPU share
            try:
                if "cpu" not in enabled:
                    _write(os.path.join(parent, "cgroup.subtree_control"), "+cpu")
                cpu = True
            except OSError:
                pass
        return CgroupLayout(
            parent if "memory" in wanted else None, parent if "pids" in wanted else None, 2, parent if cpu else None
        ), reasons
    reasons.append("no writable cgroup hierarchy (neither v1 memory/pids nor v2) is visible")
    return None, reasons


class RunCgroup:
    """The cgroup(s) of one run. Create with :meth:`create`, always finish with :meth:`remove`."""

    def __init__(self, layout: CgroupLayout, name: str) -> None:
        self.layout = layout
        self.name = name
        self.directories: list[str] = []  # created so far, removed in reverse

    @classmethod
    def create(cls, layout: CgroupLayout, memory_bytes: int | None, max_pids: int | None) -> "RunCgroup":
        """Make the cgroup(s) and set the limits; on failure remove what was made and re-raise OSError."""
        with _counter_lock:
            name = f"{_PREFIX}{os.getpid()}_{next(_counter)}"
        run = cls(layout, name)
        try:
            # v1: one directory per controller hierarchy; v2: one directory holding both controllers.
            memory_dir = run._make(layout.memory_parent) if layout.memory_parent else None
            if layout.pids_parent is None:
                pids_dir = None
            elif layout.version == 2 and memory_dir is not None:
                pids_dir = memory_dir
            else:
                pids_dir = run._make(layout.pids_parent)
            if memory_dir is not None and memory_bytes is not None:
                if layout.version == 1:
                    _write(os.path.join(memory_dir, "memory.limit_in_bytes"), str(memory_bytes))
                    swap_limit = os.path.join(memory_dir, "memory.memsw.limit_in_bytes")
                    if os.path.exists(swap_limit):  # memory + swap together: no escape into swap
                        _write(swap_limit, str(memory_bytes))
                else:
                    _write(os.path.join(memory_dir, "memory.max"), str(memory_bytes))
                    swap_limit = os.path.join(memory_dir, "memory.swap.max")
                    if os.path.exists(swap_limit):
                        _write(swap_limit, "0")
            if pids_dir is not None and max_pids is not None:
                _write(os.path.join(pids_dir, "pids.max"), str(max_pids))
            if layout.cpu_parent is not None and layout.version == 1:
                run._make(layout.cpu_parent)
        except OSError:
            run.remove(timeout_s=1.0)
            raise
        return run

    def _make(self, parent: str) -> str:
        directory = os.path.join(parent, self.name)
        os.mkdir(directory)
        self.directories.append(directory)
        return directory

    @property
    def procs_files(self) -> list[str]:
        """``cgroup.procs`` of every directory: a process joins the run by writing its pid to each."""
        return [os.path.join(directory, "cgroup.procs") for directory in self.directories]

    def members(self) -> set[int]:
        """Pids currently in the run's cgroup(s) (exited processes are not listed)."""
        found: set[int] = set()
        for procs in self.procs_files:
            try:
                with open(procs, encoding="ascii") as handle:
                    found.update(int(pid) for pid in handle.read().split())
            except OSError:
                continue
        return found

    def oom_kills(self) -> int:
        """How many processes of this run the kernel killed for exceeding the memory limit."""
        if not self.layout.memory_parent:
            return 0
        directory = os.path.join(self.layout.memory_parent, self.name)
        filename = "memory.oom_control" if self.layout.version == 1 else "memory.events"
        try:
            with open(os.path.join(directory, filename), encoding="ascii") as handle:
                for line in handle:
                    key, _, value = line.partition(" ")
                    if key == "oom_kill":
                        return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def shmem_bytes(self) -> int | None:
        """Shared memory (tmpfs, memfd, SysV shm) still charged to the run; None without a memory cgroup."""
        if not self.layout.memory_parent:
            return None
        try:
            with open(os.path.join(self.layout.memory_parent, self.name, "memory.stat"), encoding="ascii") as handle:
                for line in handle:
                    key, _, value = line.partition(" ")
                    if key == "shmem":
                        return int(value)
        except (OSError, ValueError):
            pass
        return None

    def kill_all(self, timeout_s: float) -> bool:
        """SIGKILL every member until none is left (a forking process is killed again). True if empty."""
        deadline = time.monotonic() + timeout_s
        while True:
            members = self.members()
            if not members:
                return True
            if time.monotonic() >= deadline:
                return False
            for pid in members:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            time.sleep(0.005)

    def remove(self, timeout_s: float) -> str | None:
        """Kill what is left and remove the directories. Returns None, or what could not be removed."""
        if self.directories and not self.kill_all(timeout_s):
            return f"cgroup {self.name} still has processes {sorted(self.members())[:10]} after SIGKILL"
        failures = []
        deadline = time.monotonic() + timeout_s
        for directory in reversed(self.directories):
            while True:
                try:
                    os.rmdir(directory)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:  # EBUSY right after the last exit: the kernel is still tearing down
                    if time.monotonic() >= deadline:
                        failures.append(f"{directory}: {exc}")
                        break
                    time.sleep(0.01)
        self.directories = [d for d in self.directories if os.path.isdir(d)]
        return "; ".join(failures) or None


def probe(memory_bytes: int | None, max_pids: int | None) -> tuple[CgroupLayout | None, list[str]]:
    """The layout if a test cgroup can be created with these limits and removed again; else why not."""
    try:
        layout, reasons = _candidate_layout()
    except OSError as exc:
        return None, [f"cannot read this process's cgroups: {exc}"]
    if layout is None:
        return None, reasons
    try:
        test = RunCgroup.create(layout, memory_bytes, max_pids)
    except OSError as exc:
        return None, [f"cannot create a cgroup below {layout.memory_parent or layout.pids_parent}: {exc}"]
    error = test.remove(timeout_s=2.0)
    if error:
        return None, [f"cannot remove a test cgroup: {error}"]
    return layout, reasons


def remove_stale(layout: CgroupLayout) -> int:
    """Remove empty run cgroups left by trainers that no longer exist. Returns how many went."""
    removed = 0
    for parent in {layout.memory_parent, layout.pids_parent, layout.cpu_parent} - {None}:
        try:
            entries = os.listdir(parent)
        except OSError:
            continue
        for entry in entries:
            if not entry.startswith(_PREFIX):
                continue
            owner = entry[len(_PREFIX):].split("_", 1)[0]
            if owner.isdigit() and int(owner) != os.getpid() and not os.path.exists(f"/proc/{owner}"):
                try:
                    os.rmdir(os.path.join(parent, entry))
                    removed += 1
                except OSError:
                    pass
    return removed
