"""Run untrusted Python code on this machine, contained by bubblewrap. Linux only.

    sandbox = LocalSandbox(timeout_s=10)
    result = sandbox.run("print(2 + 3)")     # SandboxResult(stdout='5\\n', exit_code=0, error_kind=None, ...)

One run: a slot with a uid of its own; a cgroup of its own (``cgroup.py``; else per-process rlimits); a
launcher that sets rlimits and ``exec``s bwrap with new namespaces, the allowlist seccomp filter of
``syscall_filter.py``, an empty root holding only read-only system and interpreter directories and private
tmpfs mounts, and dropped privileges; at the deadline the PID namespace's init is killed and the teardown
runs in a thread of its own. Any OOM kill in the run's cgroup is ``error_kind="memory"``.

Details (guarantees, measurements, the remaining channels, why bubblewrap): docs/tasks.md (Code sandbox:
LocalSandbox).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import math
import os
import pwd
import select
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from . import cgroup as cgroups
from . import syscall_filter

__all__ = [
    "IsolationReport",
    "LocalSandbox",
    "SandboxResult",
    "SandboxUnavailableError",
    "detect_isolation",
]

logger = logging.getLogger(__name__)


@dataclass
class SandboxResult:
    """Outcome of running one piece of code (same type for every sandbox backend).

    Attributes:
        stdout, stderr: captured text (UTF-8, undecodable bytes replaced). When longer than the
            backend's cap, the head and the tail are kept around a ``...[N bytes truncated]...`` marker.
        exit_code: the program's exit status; ``-N`` when killed by signal N; None when unknown
            (timeout, sandbox failure, unreachable server).
        timed_out: the wall-clock limit was hit and the program was killed.
        error_kind: None on success, else one of
            ``"timeout"`` (wall clock), ``"cpu_limit"`` (RLIMIT_CPU), ``"memory"`` (MemoryError, or the
            run's memory cgroup OOM-killed any of its processes: checked before everything else), ``"file_size"`` (RLIMIT_FSIZE), ``"killed"`` (any
            other signal), ``"runtime_error"`` (non-zero exit, e.g. an uncaught exception),
            ``"sandbox_error"`` (the sandbox itself failed: not the code's fault),
            ``"unreachable"`` (remote sandbox could not be reached; see ``fusion``).
        wall_s: wall-clock seconds of the run.
        stdout_truncated, stderr_truncated: output was longer than the cap.
        detail: extra explanation for sandbox-side failures.
        process_group: id of the process group the run used (local backend; for diagnostics/tests).
        cleanup_error: None when everything the run created is gone (processes, cgroup) or, for a
            teardown that outlasts ``timeout_s + 0.6`` s, still being removed in the background (see
            ``LocalSandbox.teardown_errors``); else what is left. The result itself is still valid.
    """

    stdout: str
    stderr: str
    exit_code: int | None
    timed_out: bool
    error_kind: str | None
    wall_s: float
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    detail: str | None = None
    process_group: int | None = None
    cleanup_error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        """Plain-dict form (for logging / JSON)."""
        return dict(self.__dict__)

    @property
    def ok(self) -> bool:
        """True when the code ran to completion with exit status 0."""
        return self.error_kind is None and self.exit_code == 0

    @property
    def sandbox_failed(self) -> bool:
        """True when the failure is the infrastructure's, not the code's (drop, don't penalise)."""
        return self.error_kind in ("sandbox_error", "unreachable")


class SandboxUnavailableError(RuntimeError):
    """The sandbox cannot run code safely/at all on this machine with this configuration."""


@dataclass(frozen=True)
class IsolationReport:
    """Which containment mechanisms a :class:`LocalSandbox` uses on this machine.

    Attributes:
        network_isolated: fresh network namespace (no interfaces up, no abstract Unix sockets of the host).
        filesystem_readonly: an empty root with only read-only binds of the interpreter and system
            libraries; writable places are the run's private tmpfs mounts.
        pid_namespace: private PID namespace (all leftovers die with the run).
        privileges_dropped: runs as a per-slot uid instead of the caller's user (caller is root).
        process_limit: processes + threads one run may have (pids cgroup and/or RLIMIT_NPROC).
        user_namespace: bwrap runs unprivileged inside a user namespace (caller is not root).
        memory_scope: ``"cgroup"`` (``memory_limit_mb`` covers all processes of a run together) or
            ``"per_process"`` (RLIMIT_AS per process x the process limit <= ``memory_limit_mb``).
        per_process_memory_mb: RLIMIT_AS of each process.
        slot_uids: the uid of each concurrency slot, claimed by this instance (empty when not root,
            and from :func:`detect_isolation`, which has no instance).
        seccomp: the syscalls the run's seccomp filter refuses by name (and the refused clone flags); the
            filter is an allowlist, so everything outside ``syscall_filter.ALLOWED`` is refused too.
        warnings: what is weaker than the full setup and why.
    """

    network_isolated: bool
    filesystem_readonly: bool
    pid_namespace: bool
    privileges_dropped: bool
    process_limit: int | None
    user_namespace: bool = False
    memory_scope: str = "per_process"
    per_process_memory_mb: int | None = None
    slot_uids: tuple[int, ...] = ()
    seccomp: tuple[str, ...] = ()
    warnings: tuple[str, ...] = ()


_SCRIPT_NAME = "main.py"
_WORKDIR = "/workdir"  # inside the sandbox; every run has its own (a tmpfs in its own mount namespace)
_DEFAULT_PATH = "/usr/local/bin:/usr/bin:/bin"
_LAUNCHER_SETUP_FAILED = 125
# /etc entries the dynamic loader and libc need; nothing else of /etc (no passwd, hosts, ssl keys).
_ETC_ENTRIES = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "localtime", "alternatives")
_TOP_LEVEL_SYSTEM = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")
# The run's own mounts and directories (step 3): an interpreter below one is bound after it, never into one.
_PRIVATE_MOUNTS = ("/proc", "/dev", "/dev/shm", "/tmp", "/run", "/var", _WORKDIR)
_RUN_SLACK_S = 0.6  # run() returns at most this long after timeout_s (teardown goes on in the background)
_UID_SEARCH_SPAN = 1024  # uids tried from sandbox_uid up when claiming an instance's slot uids
_NEVER_UIDS = (65534, 65535)  # nobody, and (uid_t)-1 in 16 bits
_UID_CLAIM_PREFIX = "async_rl_sandbox_uid_"
_CAP_SYS_RESOURCE = 24
_GC_WAIT_S = 2.0  # teardown: longest wait for the kernel to free a dead run's in-flight Unix-socket files

# Joins the run's cgroup, sets the limits, ties itself to the trainer thread, then becomes bwrap. Runs with
# -I -S (no site, no environment) from a string so that no file of this project is needed to start it.
_LAUNCHER = r"""
import ctypes, json, os, resource, sys
config = json.loads(sys.argv[1])
status_fd = config["status_fd"]
try:
    for procs in config["cgroup_procs"]:
        with open(procs, "w") as handle:
            handle.write(str(os.getpid()))
    for name, soft, hard in config["rlimits"]:
        resource.setrlimit(getattr(resource, name), (soft, hard))
    if config["nice"]:
        os.nice(config["nice"])
    if config["oom_score_adj"] is not None:  # bwrap and its init: never the OOM killer's choice
        with open("/proc/self/oom_score_adj", "w") as handle:
            handle.write(str(config["oom_score_adj"]))
    libc = ctypes.CDLL(None, use_errno=True)
    if config["keyctl"] is not None:  # KEYCTL_JOIN_SESSION_KEYRING (1) with no name: a new, empty one
        libc.syscall.restype = ctypes.c_long
        if libc.syscall(ctypes.c_long(config["keyctl"]), ctypes.c_long(1), ctypes.c_void_p(None)) < 0:
            error = ctypes.get_errno()
            if error not in (1, 38):  # EPERM (keyctl refused by an outer filter), ENOSYS (no keyrings)
                raise OSError(error, "keyctl(KEYCTL_JOIN_SESSION_KEYRING) failed: " + os.strerror(error))
    if libc.prctl(1, 9, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG = 1, SIGKILL = 9
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != config["parent_pid"]:
        raise RuntimeError("the trainer exited while the sandbox started")
    os.set_inheritable(status_fd, False)
    os.execv(config["argv"][0], config["argv"])
except BaseException as exc:
    os.write(status_fd, json.dumps({"setup_error": f"sandbox launcher: {type(exc).__name__}: {exc}"}).encode())
    os._exit(125)
"""


# --------------------------------------------------------------------------------------------------
# What the sandbox exposes
# --------------------------------------------------------------------------------------------------


def _interpreter_paths(python: str) -> dict[str, Any]:
    """Prefixes, sys.path and the executable's symlink targets, asked from the interpreter itself."""
    query = (
        "import sys, json; print(json.dumps({'prefixes': [sys.prefix, sys.base_prefix, sys.exec_prefix, "
        "sys.base_exec_prefix], 'path': [p for p in sys.path if p], 'version': list(sys.version_info[:2])}))"
    )
    try:
        completed = subprocess.run(
            [python, "-I", "-c", query], capture_output=True, text=True, timeout=60, env={"PATH": _DEFAULT_PATH}
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxUnavailableError(
            f"python_executable {python!r} cannot be started ({exc}). Pass python_executable= a working Python 3."
        ) from None
    if completed.returncode != 0:
        raise SandboxUnavailableError(
            f"python_executable {python!r} does not run: {completed.stderr.strip()[-500:]}. "
            "Pass python_executable= pointing to a working Python 3."
        )
    return json.loads(completed.stdout)


def _symlink_chain(path: str) -> list[str]:
    """``path`` and every intermediate symlink target up to the real file (all must exist inside)."""
    chain, current = [], os.path.abspath(path)
    for _ in range(40):  # the kernel's own symlink limit
        chain.append(current)
        if not os.path.islink(current):
            break
        current = os.path.normpath(os.path.join(os.path.dirname(current), os.readlink(current)))
    return chain


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")


def _exposed_directories(python: str) -> list[str]:
    """Host directories bound read-only into the sandbox for the interpreter (besides /usr, /etc bits).

    The interpreter's prefixes and its site-/dist-packages directories; *not* other sys.path entries
    (an editable install's source tree, the current directory): the project stays invisible.
    """
    info = _interpreter_paths(python)
    wanted = [os.path.dirname(p) for p in _symlink_chain(python)] + list(info["prefixes"])
    wanted += [p for p in info["path"] if os.path.basename(p.rstrip("/")) in ("site-packages", "dist-packages")]
    chosen: list[str] = []
    for path in sorted({os.path.realpath(p) for p in wanted} | {os.path.abspath(p) for p in wanted}, key=len):
        if not os.path.isdir(path) or path == "/":
            continue
        if _within(path, "/usr") or any(_within(path, kept) for kept in chosen):
            continue
        chosen.append(path)
    return chosen


def _system_arguments() -> list[str]:
    """bwrap arguments for the system part of the new root: /usr, the top-level links, the loader's /etc files."""
    arguments = ["--ro-bind", "/usr", "/usr"]
    for name in _TOP_LEVEL_SYSTEM:
        host = "/" + name
        if os.path.islink(host):
            arguments += ["--symlink", os.readlink(host), host]
        elif os.path.isdir(host):
            arguments += ["--ro-bind", host, host]
    for name in _ETC_ENTRIES:
        host = os.path.join("/etc", name)
        if os.path.exists(host):
            arguments += ["--ro-bind", host, host]
    return arguments


def _interpreter_arguments(exposed: list[str]) -> list[str]:
    """bwrap arguments binding the interpreter's directories; they come after the run's own mounts, so a
    venv under ``/tmp`` or ``/dev/shm`` lands on the run's tmpfs instead of being hidden by it.

    Raises:
        SandboxUnavailableError: a directory would cover one of the run's own mounts (e.g. a prefix of
            ``/tmp`` itself would expose the host's ``/tmp``) or lies in ``/proc``, ``/dev`` or ``/workdir``.
    """
    for directory in exposed:
        covered = [m for m in _PRIVATE_MOUNTS if _within(m, directory)]
        inside = [m for m in ("/proc", _WORKDIR) if _within(directory, m)]
        if _within(directory, "/dev") and not _within(directory, "/dev/shm"):
            inside.append("/dev")
        if covered or inside:
            raise SandboxUnavailableError(
                f"the interpreter's directory {directory} cannot be bound into the sandbox: it "
                + (f"would cover the run's own {', '.join(covered)}" if covered else f"lies in {inside[0]}")
                + ". Fix: use an interpreter/venv in a directory of its own (e.g. /opt/venv or /tmp/<name>/.venv)"
            )
    arguments: list[str] = []
    created: set[str] = {*_PRIVATE_MOUNTS, "/var/run", "/var/tmp"}  # exist already (the last two: links)
    for directory in exposed:
        # bwrap would create missing parents with mode 0700 (unusable for the slot uid): make them 0755.
        parts = directory.strip("/").split("/")
        for depth in range(1, len(parts)):
            parent = "/" + "/".join(parts[:depth])
            if parent not in created and not any(_within(parent, d) for d in exposed if d != directory):
                arguments += ["--perms", "0755", "--dir", parent]
                created.add(parent)
        arguments += ["--ro-bind", directory, directory]
    return arguments


# --------------------------------------------------------------------------------------------------
# Machine capabilities (probed once per configuration and process)
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Capabilities:
    bwrap: str
    bwrap_version: str
    setpriv: str | None
    prlimit: str
    choom: str
    is_root: bool
    oom_floor: bool  # root with CAP_SYS_RESOURCE: bwrap at -1000, the code at 1000 and unable to go lower
    layout: cgroups.CgroupLayout | None
    system_binds: tuple[str, ...]
    interpreter_binds: tuple[str, ...]
    seccomp_program: bytes  # BPF for bwrap --seccomp (syscall_filter.build_program)
    keyctl_number: int | None  # for the launcher's KEYCTL_JOIN_SESSION_KEYRING
    report: IsolationReport


_CAPABILITY_CACHE: dict[tuple, _Capabilities] = {}
_CAPABILITY_LOCK = threading.Lock()


def _require_tool(name: str, package: str) -> str:
    path = shutil.which(name, path=_DEFAULT_PATH + ":/usr/sbin:/sbin")
    if path is None:
        raise SandboxUnavailableError(
            f"LocalSandbox needs {name!r}, which is not installed. Fix: apt-get install {package} "
            f"(Debian/Ubuntu; dnf/pacman have the same package), or use the SandboxFusion backend "
            "(env.sandbox.kind=fusion)."
        )
    return path


def _memory_plan(memory_limit_mb: int, process_memory_mb: int, max_processes: int, cgroup_memory: bool) -> tuple[int, int]:
    """``(per-process RLIMIT_AS in MB, processes per run)``; without a memory cgroup their product is
    at most ``memory_limit_mb`` (module docstring, step 2)."""
    if cgroup_memory:
        return memory_limit_mb, max_processes
    per_process = min(process_memory_mb, memory_limit_mb)
    return per_process, max(1, min(max_processes, memory_limit_mb // per_process))


def detect_isolation(
    python_executable: str | None = None,
    sandbox_uid: int = 65000,
    sandbox_gid: int = 65000,
    max_processes: int = 64,
    memory_limit_mb: int = 1024,
    process_memory_mb: int = 256,
    max_concurrency: int = 4,
) -> IsolationReport:
    """What containment a LocalSandbox with these settings gets here (probed once, then cached).

    ``sandbox_uid``, ``sandbox_gid`` and ``max_concurrency`` are accepted for symmetry with
    :class:`LocalSandbox`; uids are claimed per instance, so ``slot_uids`` is empty here.

    Raises:
        SandboxUnavailableError: bwrap, libseccomp (or, as root, setpriv/prlimit/choom) is missing, or not Linux.
    """
    del sandbox_uid, sandbox_gid, max_concurrency
    return _detect_capabilities(
        os.path.abspath(python_executable or sys.executable), max_processes, memory_limit_mb, process_memory_mb,
    ).report


def _detect_capabilities(python: str, max_processes: int, memory_limit_mb: int, process_memory_mb: int) -> _Capabilities:
    key = (python, max_processes, memory_limit_mb, process_memory_mb, os.geteuid())
    with _CAPABILITY_LOCK:
        if key in _CAPABILITY_CACHE:
            return _CAPABILITY_CACHE[key]
        if not sys.platform.startswith("linux"):
            raise SandboxUnavailableError("LocalSandbox needs Linux; use the SandboxFusion backend elsewhere")
        bwrap = _require_tool("bwrap", "bubblewrap")
        try:
            bwrap_version = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise SandboxUnavailableError(f"{bwrap} --version failed ({exc}); reinstall bubblewrap") from None
        prlimit = _require_tool("prlimit", "util-linux")
        choom = _require_tool("choom", "util-linux")
        is_root = os.geteuid() == 0
        setpriv = _require_tool("setpriv", "util-linux") if is_root else None
        oom_floor = is_root and _has_capability(_CAP_SYS_RESOURCE)
        try:
            seccomp_program, seccomp_summary = syscall_filter.build_program()
            keyctl_number = syscall_filter.syscall_number("keyctl")
        except syscall_filter.SeccompUnavailableError as exc:
            raise SandboxUnavailableError(str(exc)) from None
        warnings: list[str] = []
        layout, reasons = cgroups.probe(memory_limit_mb * 1024 * 1024, max_processes)
        if layout is not None:
            cgroups.remove_stale(layout)
        cgroup_memory = layout is not None and layout.memory_parent is not None
        if not cgroup_memory:
            warnings.append(
                "no memory cgroup (" + "; ".join(reasons or ["memory controller missing"]) + "): the memory "
                "limit is per process; a run is capped at processes x per-process memory <= memory_limit_mb"
            )
        per_process_mb, processes = _memory_plan(memory_limit_mb, process_memory_mb, max_processes, cgroup_memory)
        if not is_root:
            warnings.append(
                "not running as root: every run uses the trainer's own uid inside an unprivileged user "
                "namespace (no per-slot uids); its process limit is counted inside that namespace"
            )
        if not oom_floor:
            logger.info("LocalSandbox: no CAP_SYS_RESOURCE: the code starts at oom_score_adj 1000 but may lower it "
                        "to the trainer's; an OOM kill is still reported as error_kind='memory'")
        report = IsolationReport(
            network_isolated=True,
            filesystem_readonly=True,
            pid_namespace=True,
            privileges_dropped=is_root,
            process_limit=processes,
            user_namespace=not is_root,
            memory_scope="cgroup" if cgroup_memory else "per_process",
            per_process_memory_mb=per_process_mb,
            seccomp=tuple(seccomp_summary["refused"]) + tuple(f"clone({flag})" for flag in seccomp_summary["clone_flags"]),
            warnings=tuple(warnings),
        )
        for warning in warnings:
            logger.warning("LocalSandbox: %s", warning)
        capabilities = _Capabilities(
            bwrap, bwrap_version, setpriv, prlimit, choom, is_root, oom_floor, layout, tuple(_system_arguments()),
            tuple(_interpreter_arguments(_exposed_directories(python))), seccomp_program, keyctl_number, report,
        )
        _CAPABILITY_CACHE[key] = capabilities
        return capabilities


class _UidClaim:
    """This instance's slot uids, claimed host-wide (module docstring, step 1).

    A claim on uid ``u`` is a bound abstract Unix socket ``@async_rl_sandbox_uid_<u>``: another process's
    bind of the same name fails, and the kernel drops the name when the socket is closed or its process
    dies, so a killed trainer never leaves a stale claim.
    """

    def __init__(self, first_uid: int, count: int) -> None:
        self.sockets: list[socket.socket] = []
        self.uids: list[int] = []
        live = _live_uids()
        for uid in range(first_uid, first_uid + _UID_SEARCH_SPAN):
            if len(self.uids) == count:
                break
            if uid in _NEVER_UIDS or uid in live or _has_account(uid):
                continue
            claim = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                claim.bind(f"\0{_UID_CLAIM_PREFIX}{uid}")
            except OSError:  # claimed by another instance (of this or another process)
                claim.close()
                continue
            self.sockets.append(claim)
            self.uids.append(uid)
        if len(self.uids) < count:
            self.release()
            raise SandboxUnavailableError(
                f"cannot claim {count} free sandbox uids in {first_uid}..{first_uid + _UID_SEARCH_SPAN - 1} "
                "(each must have no account, no live process and no other LocalSandbox using it). Fix: close "
                "unused LocalSandbox instances or pass another sandbox_uid/sandbox_gid range"
            )

    def release(self) -> None:
        for claim in self.sockets:
            claim.close()
        self.sockets.clear()


def _has_capability(number: int) -> bool:
    """Whether this process has capability ``number`` in its effective set."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> number & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False


def _has_account(uid: int) -> bool:
    try:
        pwd.getpwuid(uid)
    except KeyError:
        return False
    return True


def _live_uids() -> set[int]:
    """Real uids of the live processes on this machine (as seen from here)."""
    uids: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", encoding="ascii", errors="replace") as handle:
                for line in handle:
                    if line.startswith("Uid:"):
                        uids.add(int(line.split()[1]))
                        break
        except (OSError, ValueError, IndexError):
            continue
    return uids


# --------------------------------------------------------------------------------------------------
# Caller side helpers
# --------------------------------------------------------------------------------------------------


class _CappedBuffer:
    """Keeps the first and last ``limit/2`` bytes of a stream and counts what is dropped between."""

    def __init__(self, limit: int) -> None:
        self.head_limit = limit // 2
        self.tail_limit = limit - self.head_limit
        self.head = bytearray()
        self.tail = bytearray()
        self.dropped = 0

    def add(self, data: bytes) -> None:
        room = self.head_limit - len(self.head)
        if room > 0:
            self.head += data[:room]
            data = data[room:]
        if not data:
            return
        self.tail += data
        overflow = len(self.tail) - self.tail_limit
        if overflow > 0:
            del self.tail[:overflow]
            self.dropped += overflow

    def text(self) -> tuple[str, bool]:
        truncated = self.dropped > 0
        middle = f"\n...[{self.dropped} bytes truncated]...\n".encode() if truncated else b""
        return bytes(self.head + middle + self.tail).decode("utf-8", errors="replace"), truncated


def _kill_group(process_group: int) -> None:
    try:
        os.killpg(process_group, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _json_documents(data: bytes) -> list[dict[str, Any]]:
    """bwrap's ``--json-status-fd`` stream: JSON objects one after another (whitespace between)."""
    decoder, text, index, documents = json.JSONDecoder(), data.decode("utf-8", errors="replace"), 0, []
    while True:
        while index < len(text) and text[index].isspace():
            index += 1
        if index >= len(text):
            return documents
        try:
            document, index = decoder.raw_decode(text, index)
        except json.JSONDecodeError:
            return documents
        if isinstance(document, dict):
            documents.append(document)


@dataclass
class _Run:
    """Host-side state of one run, everything the teardown needs."""

    process: subprocess.Popen | None = None
    init_pidfd: int | None = None  # the PID namespace's init (bwrap's child): its exit ends the namespace
    mount_ns_fd: int | None = None  # holds the run's mount namespace: dropped (unmounted) by the teardown
    cgroup: cgroups.RunCgroup | None = None
    fds: list[int] = field(default_factory=list)
    cleanup_error: str | None = None
    finished: bool = False  # the teardown is over
    detached: bool = False  # run() returned before the teardown was over


class LocalSandbox:
    """Run Python code in a bubblewrap cage on this machine (see the module docstring).

    Args:
        timeout_s: default wall-clock limit per run (python start-up included).
        memory_limit_mb: memory of one run, all its processes (and its tmpfs files) together, when a
            memory cgroup is available; also each process's RLIMIT_AS (virtual memory: leave room for
            imports). Without a cgroup see ``process_memory_mb``.
        process_memory_mb: only without a memory cgroup: RLIMIT_AS per process; a run may then have
            ``memory_limit_mb // process_memory_mb`` processes (at most ``max_processes``).
        cpu_time_limit_s: RLIMIT_CPU per process; default ``ceil(timeout_s) + 1``.
        max_file_size_mb: RLIMIT_FSIZE, the largest file the code may write.
        tmpfs_size_mb: size of each private tmpfs (``/workdir``, ``/tmp``, ``/dev/shm``).
        max_open_files: RLIMIT_NOFILE.
        max_processes: processes + threads of one run (the pids cgroup, where bwrap's own two count too;
            without one, RLIMIT_NPROC of the slot uid).
        max_output_bytes: cap per stream on captured stdout/stderr (head and tail kept).
        max_concurrency: concurrent runs through this instance (one uid each); more callers wait.
        python_executable: interpreter for the code (default: the current one, with its packages).
        sandbox_uid, sandbox_gid: where the search for this instance's slot uids starts when the caller
            is root (the first ``max_concurrency`` free uids from here up; the gid of uid ``u`` is
            ``sandbox_gid + (u - sandbox_uid)``). See :attr:`slot_uids`. The default 65000 starts
            Debian's never-assigned 65000-65533 range.
        extra_env: additional environment variables for the code.
        nice: niceness added to the code's processes (a spinning program must not starve the trainer).
        strict: raise :class:`SandboxUnavailableError` unless the run's memory is limited by a cgroup and
            runs use per-slot uids (the caller is root).

    Raises:
        SandboxUnavailableError: the sandbox cannot run code here (the message says why and how to fix).
        ValueError: a setting is out of range (the message names it).
    """

    def __init__(
        self,
        timeout_s: float = 10.0,
        memory_limit_mb: int = 1024,
        process_memory_mb: int = 256,
        cpu_time_limit_s: int | None = None,
        max_file_size_mb: int = 16,
        tmpfs_size_mb: int = 64,
        max_open_files: int = 256,
        max_processes: int = 64,
        max_output_bytes: int = 64 * 1024,
        max_concurrency: int = 4,
        python_executable: str | None = None,
        sandbox_uid: int = 65000,
        sandbox_gid: int = 65000,
        extra_env: dict[str, str] | None = None,
        nice: int = 10,
        strict: bool = False,
    ) -> None:
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        for name, value in (
            ("memory_limit_mb", memory_limit_mb), ("process_memory_mb", process_memory_mb),
            ("max_file_size_mb", max_file_size_mb), ("tmpfs_size_mb", tmpfs_size_mb),
            ("max_open_files", max_open_files), ("max_processes", max_processes),
            ("max_output_bytes", max_output_bytes), ("max_concurrency", max_concurrency),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if cpu_time_limit_s is not None and (not isinstance(cpu_time_limit_s, int) or cpu_time_limit_s < 1):
            raise ValueError(f"cpu_time_limit_s must be an integer >= 1 or None, got {cpu_time_limit_s!r}")
        if sandbox_uid < 1 or sandbox_gid < 1:
            raise ValueError(
                f"sandbox_uid/sandbox_gid must be >= 1 (never root), got {sandbox_uid}/{sandbox_gid}; "
                "use an unprivileged range such as 65000"
            )
        self.timeout_s = timeout_s
        self.memory_limit_mb = memory_limit_mb
        self.process_memory_mb = process_memory_mb
        self.cpu_time_limit_s = cpu_time_limit_s
        self.max_file_size_mb = max_file_size_mb
        self.tmpfs_size_mb = tmpfs_size_mb
        self.max_open_files = max_open_files
        self.max_processes = max_processes
        self.max_output_bytes = max_output_bytes
        self.max_concurrency = max_concurrency
        self.python_executable = os.path.abspath(python_executable or sys.executable)
        self.sandbox_uid = sandbox_uid
        self.sandbox_gid = sandbox_gid
        self.extra_env = dict(extra_env or {})
        self.nice = nice
        self._free_slots = list(range(max_concurrency))
        self._slots_changed = threading.Condition()
        self._closed = False
        self.teardown_errors: list[str] = []  # failures of teardowns that finished after run() returned
        self._capabilities = _detect_capabilities(
            self.python_executable, max_processes, memory_limit_mb, process_memory_mb,
        )
        self._uid_claim: _UidClaim | None = None
        self.slot_uids: tuple[int, ...] = ()
        self.slot_gids: tuple[int, ...] = ()
        report = self._capabilities.report
        if self._capabilities.is_root:
            self._uid_claim = _UidClaim(sandbox_uid, max_concurrency)
            self.slot_uids = tuple(self._uid_claim.uids)
            self.slot_gids = tuple(sandbox_gid + (uid - sandbox_uid) for uid in self.slot_uids)
            report = dataclasses.replace(report, slot_uids=self.slot_uids)
        self._report = report
        if strict:
            missing = [name for name, ok in (("a memory cgroup", report.memory_scope == "cgroup"),
                                             ("per-slot uids (run as root)", report.privileges_dropped)) if not ok]
            if missing:
                self.close()
                raise SandboxUnavailableError(
                    f"strict LocalSandbox: missing {', '.join(missing)} ({'; '.join(report.warnings)}). "
                    "Run as root with a writable cgroup hierarchy, or use the SandboxFusion backend."
                )
        try:
            self._smoke_test()
        except BaseException:
            self.close()
            raise

    # -- public ------------------------------------------------------------------------------------

    @property
    def isolation(self) -> IsolationReport:
        """The containment mechanisms in force (see :class:`IsolationReport`)."""
        return self._report

    @property
    def network_isolated(self) -> bool:
        return self._report.network_isolated

    def run(self, code: str, timeout_s: float | None = None, stdin: str | None = None) -> SandboxResult:
        """Execute ``code`` as a Python script; blocks until done, at most ``timeout_s`` + 0.6 s (plus the
        wait for a free slot).

        Whatever the code does, this returns a :class:`SandboxResult`: infrastructure failures are
        ``error_kind="sandbox_error"`` and leftovers are reported in ``cleanup_error``.

        Raises:
            ValueError: ``timeout_s`` is not positive (a caller bug, not the code's doing).
            RuntimeError: the sandbox was closed.
        """
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if not timeout > 0:
            raise ValueError(f"timeout_s must be positive, got {timeout}")
        slot = self._take_slot()
        return self._run_once(code, timeout, stdin, slot)  # gives the slot back when its teardown is over

    async def arun(self, code: str, timeout_s: float | None = None, stdin: str | None = None) -> SandboxResult:
        """``await``-able :meth:`run` (runs in a worker thread; the event loop is never blocked)."""
        return await asyncio.to_thread(self.run, code, timeout_s, stdin)

    def wait_idle(self, timeout_s: float | None = None) -> bool:
        """Wait until no run and no teardown is in progress. True if idle, False on timeout."""
        with self._slots_changed:
            return self._slots_changed.wait_for(lambda: len(self._free_slots) == self.max_concurrency, timeout_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Wait (at most ``timeout_s``) for runs and teardowns in progress, then release the slot uids.
        Later :meth:`run` calls raise RuntimeError. Idempotent."""
        with self._slots_changed:
            self._closed = True
            self._slots_changed.notify_all()
        self.wait_idle(timeout_s)
        if self._uid_claim is not None:
            self._uid_claim.release()

    def __enter__(self) -> "LocalSandbox":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    # -- slots -------------------------------------------------------------------------------------

    def _take_slot(self) -> int:
        """The lowest free slot (so a lone caller always runs as ``slot_uids[0]``); waits when none is free."""
        with self._slots_changed:
            while not self._free_slots and not self._closed:
                self._slots_changed.wait()
            if self._closed:
                raise RuntimeError("this LocalSandbox is closed; create a new one")
            slot = min(self._free_slots)
            self._free_slots.remove(slot)
            return slot

    def _give_slot(self, slot: int) -> None:
        with self._slots_changed:
            self._free_slots.append(slot)
            self._slots_changed.notify_all()

    # -- internals ---------------------------------------------------------------------------------

    def _smoke_test(self) -> None:
        """Run a trivial program through the full cage once, so that a broken setup fails here, loudly."""
        result = self.run("print('sandbox-ok')", timeout_s=max(self.timeout_s, 30.0))
        if result.stdout.strip() != "sandbox-ok" or result.exit_code != 0:
            raise SandboxUnavailableError(
                "LocalSandbox self-test failed: "
                f"error_kind={result.error_kind} exit_code={result.exit_code} detail={result.detail!r} "
                f"stderr={result.stderr[-800:]!r}. Needs bubblewrap >= 0.8 (found {self._capabilities.bwrap_version!r}). "
                "If bwrap says it cannot create namespaces, run where "
                "unshare is allowed (e.g. a container with CAP_SYS_ADMIN or unprivileged user namespaces); "
                f"if python cannot start, check python_executable ({self.python_executable}) and "
                f"memory_limit_mb/process_memory_mb (per process now {self.isolation.per_process_memory_mb} MB)."
            )

    def _environment(self) -> dict[str, str]:
        env = {
            "PATH": _DEFAULT_PATH,
            "LANG": "C.UTF-8",
            "LC_ALL": "C.UTF-8",
            "HOME": _WORKDIR,
            "TMPDIR": "/tmp",
            "USER": "sandbox",
            "LOGNAME": "sandbox",
            "PYTHONDONTWRITEBYTECODE": "1",
            # Native thread pools reserve lots of virtual memory per thread (RLIMIT_AS) and each
            # thread counts against the process limit: one thread is plenty for tool calls.
            "OMP_NUM_THREADS": "1",
            "OPENBLAS_NUM_THREADS": "1",
            "MKL_NUM_THREADS": "1",
            "MPLBACKEND": "Agg",
            "MPLCONFIGDIR": _WORKDIR,
        }
        env.update(self.extra_env)
        return env

    def _meminfo(self) -> bytes:
        """The run's ``/proc/meminfo``: its own limit as total, free and available, nothing of the host.

        Static (no bit of it changes while the run goes on), so it carries nothing between runs; a program
        that sizes itself from ``MemAvailable`` (psutil, numpy's tests, joblib) sees what it may use.
        """
        limit_kb = self.memory_limit_mb * 1024
        fields = [("MemTotal", limit_kb), ("MemFree", limit_kb), ("MemAvailable", limit_kb)]
        fields += [(name, 0) for name in ("Buffers", "Cached", "SwapCached", "Active", "Inactive", "SwapTotal",
                                          "SwapFree", "Dirty", "Writeback", "AnonPages", "Mapped", "Shmem")]
        return "".join(f"{name + ':':<16}{value:>8} kB\n" for name, value in fields).encode("ascii")

    def _command(self, slot: int, code_fd: int, status_fd: int, seccomp_fd: int, meminfo_fd: int) -> list[str]:
        """The bwrap command line of one run (module docstring, step 3)."""
        capabilities = self._capabilities
        tmpfs_bytes = str(self.tmpfs_size_mb * 1024 * 1024)
        argv = [
            capabilities.bwrap,
            "--unshare-net", "--unshare-pid", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try",
            "--hostname", "sandbox", "--die-with-parent", "--new-session",
            "--json-status-fd", str(status_fd),
            "--seccomp", str(seccomp_fd),
        ]
        if capabilities.is_root:
            # Keep only what setpriv (the uid switch) and choom (the score's floor) need; setpriv clears all.
            argv += ["--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID",
                     "--cap-add", "CAP_SETPCAP"]
            if capabilities.oom_floor:
                argv += ["--cap-add", "CAP_SYS_RESOURCE"]
        else:
            argv += ["--unshare-user", "--disable-userns"]
        argv += list(capabilities.system_binds)
        argv += [
            "--proc", "/proc", "--perms", "0444", "--ro-bind-data", str(meminfo_fd), "/proc/meminfo", "--dev", "/dev",
            "--perms", "1777", "--size", tmpfs_bytes, "--tmpfs", "/tmp",
            "--perms", "1777", "--size", tmpfs_bytes, "--tmpfs", "/dev/shm",
            "--perms", "0755", "--dir", "/run", "--perms", "0755", "--dir", "/var",
            "--symlink", "../run", "/var/run", "--symlink", "../tmp", "/var/tmp",
            # 0777: the run is alone in its mount namespace, and the slot uid must be able to write here.
            "--perms", "0777", "--size", tmpfs_bytes, "--tmpfs", _WORKDIR,
        ]
        argv += list(capabilities.interpreter_binds)  # after the run's mounts: /tmp/<venv> stays visible
        argv += [
            "--perms", "0644", "--file", str(code_fd), f"{_WORKDIR}/{_SCRIPT_NAME}",
            "--remount-ro", "/",
            "--chdir", _WORKDIR,
            "--",
        ]
        layout = capabilities.layout
        if layout is None or layout.pids_parent is None:  # else pids.max caps the run, not a per-uid count
            processes = capabilities.report.process_limit
            argv += [capabilities.prlimit, f"--nproc={processes}:{processes}", "--"]
        argv += [capabilities.choom, "-n", "1000", "--"]
        if capabilities.is_root:
            argv += [capabilities.setpriv, f"--reuid={self.slot_uids[slot]}", f"--regid={self.slot_gids[slot]}",
                     "--clear-groups", "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", "--"]
        argv += [self.python_executable, "-I", "-B", "-u", f"{_WORKDIR}/{_SCRIPT_NAME}"]
        return argv

    def _launcher_config(self, argv: list[str], cgroup: cgroups.RunCgroup | None, timeout_s: float,
                         status_fd: int) -> dict[str, Any]:
        per_process_bytes = self._capabilities.report.per_process_memory_mb * 1024 * 1024
        cpu_s = self.cpu_time_limit_s or int(math.ceil(timeout_s)) + 1
        return {
            "argv": argv,
            "status_fd": status_fd,
            "parent_pid": os.getpid(),
            "nice": self.nice,
            "cgroup_procs": cgroup.procs_files if cgroup else [],
            # with CAP_SYS_RESOURCE: bwrap, its init and the tools before the code are never the OOM victim
            "oom_score_adj": -1000 if self._capabilities.oom_floor else None,
            "keyctl": self._capabilities.keyctl_number,
            "rlimits": [
                ["RLIMIT_CORE", 0, 0],
                # CPU: the soft limit sends SIGXCPU (reported as "cpu_limit"), the hard one SIGKILLs 1 s later.
                ["RLIMIT_CPU", cpu_s, cpu_s + 1],
                ["RLIMIT_AS", per_process_bytes, per_process_bytes],
                ["RLIMIT_FSIZE", self.max_file_size_mb * 1024 * 1024, self.max_file_size_mb * 1024 * 1024],
                ["RLIMIT_NOFILE", self.max_open_files, self.max_open_files],
            ],
        }

    def _run_once(self, code: str, timeout_s: float, stdin: str | None, slot: int) -> SandboxResult:
        started = time.monotonic()
        run = _Run()
        result = None
        try:
            try:
                result = self._start_and_collect(run, code, timeout_s, stdin, slot, started)
            except Exception as exc:  # noqa: BLE001 - never let the sandbox's own trouble escape run()
                result = SandboxResult("", "", None, False, "sandbox_error", time.monotonic() - started,
                                       detail=f"sandbox failure: {type(exc).__name__}: {exc}")
        finally:  # also on KeyboardInterrupt: never leave a run's processes or cgroup behind
            self._kill(run)
            teardown = threading.Thread(target=self._teardown, args=(run, slot), name="sandbox-teardown", daemon=True)
            teardown.start()
            teardown.join(max(0.05, started + timeout_s + _RUN_SLACK_S - time.monotonic()))
        with self._slots_changed:
            if run.finished:
                result.cleanup_error = run.cleanup_error
            else:
                run.detached = True
        if result.cleanup_error:
            logger.warning("LocalSandbox: cleanup incomplete: %s", result.cleanup_error)
        return result

    def _start_and_collect(self, run: _Run, code: str, timeout_s: float, stdin: str | None, slot: int,
                           started: float) -> SandboxResult:
        layout = self._capabilities.layout
        if layout is not None:
            memory = self.memory_limit_mb * 1024 * 1024
            try:
                run.cgroup = cgroups.RunCgroup.create(layout, memory, self.max_processes)
            except OSError as exc:
                return SandboxResult("", "", None, False, "sandbox_error", time.monotonic() - started,
                                     detail=f"could not create the run's cgroup: {exc}")
        # The program, stdin and the filter travel in anonymous memory files: nothing touches the host disk.
        code_fd = _memory_file("main.py", code.encode("utf-8", errors="surrogatepass"), run)
        seccomp_fd = _memory_file("seccomp", self._capabilities.seccomp_program, run)
        meminfo_fd = _memory_file("meminfo", self._meminfo(), run)
        stdin_fd = None
        if stdin is not None:
            stdin_fd = _memory_file("stdin", stdin.encode("utf-8", errors="surrogatepass"), run)
        launcher_read, launcher_write = os.pipe()
        bwrap_read, bwrap_write = os.pipe()
        run.fds += [launcher_read, launcher_write, bwrap_read, bwrap_write]
        argv = self._command(slot, code_fd, bwrap_write, seccomp_fd, meminfo_fd)
        config = self._launcher_config(argv, run.cgroup, timeout_s, launcher_write)
        run.process = subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", _LAUNCHER, json.dumps(config)],
            stdin=stdin_fd if stdin_fd is not None else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            pass_fds=(code_fd, seccomp_fd, meminfo_fd, launcher_write, bwrap_write),
            start_new_session=True,  # own process group: one killpg reaches the launcher/bwrap
            env=self._environment(),
            cwd="/",
        )
        for fd in (launcher_write, bwrap_write, code_fd, seccomp_fd, meminfo_fd):  # the child has them now
            os.close(fd)
            run.fds.remove(fd)
        return self._collect(run, launcher_read, bwrap_read, started, timeout_s)

    def _collect(self, run: _Run, launcher_read: int, bwrap_read: int, started: float,
                 timeout_s: float) -> SandboxResult:
        """Pump the pipes until the run ends or the deadline passes; then classify the outcome."""
        process = run.process
        deadline = started + timeout_s
        stdout_fd, stderr_fd = process.stdout.fileno(), process.stderr.fileno()
        buffers = {stdout_fd: _CappedBuffer(self.max_output_bytes), stderr_fd: _CappedBuffer(self.max_output_bytes)}
        status_bytes = {launcher_read: bytearray(), bwrap_read: bytearray()}
        selector = selectors.DefaultSelector()
        for fd in (*buffers, launcher_read, bwrap_read):
            selector.register(fd, selectors.EVENT_READ)
        timed_out = False
        finish_by: float | None = None  # once set: the run is over, drain pipes until then at most
        try:
            while selector.get_map():
                now = time.monotonic()
                if finish_by is None and process.poll() is not None:
                    finish_by = now + 0.5  # bwrap gone => the namespace is gone; drain what is buffered
                if finish_by is None and now >= deadline:
                    timed_out = True
                    self._kill(run)
                    finish_by = min(now + 0.5, deadline + _RUN_SLACK_S / 2)
                if finish_by is not None and now >= finish_by:
                    break
                wait = (finish_by if finish_by is not None else deadline) - now
                for key, _ in selector.select(timeout=max(0.0, min(wait, 0.05))):
                    data = os.read(key.fd, 65536)
                    if not data:
                        selector.unregister(key.fd)
                    elif key.fd in status_bytes:
                        status_bytes[key.fd] += data
                        if key.fd == bwrap_read and run.init_pidfd is None:
                            self._track_init(run, status_bytes[bwrap_read])
                    else:
                        buffers[key.fd].add(data)
        finally:
            selector.close()
        wall_s = time.monotonic() - started
        self._kill(run)

        status: dict[str, Any] = {}
        for document in _json_documents(bytes(status_bytes[bwrap_read])) + _json_documents(
            bytes(status_bytes[launcher_read])
        ):
            status.update(document)
        stdout, stdout_truncated = buffers[stdout_fd].text()
        stderr, stderr_truncated = buffers[stderr_fd].text()
        oom_kills = run.cgroup.oom_kills() if run.cgroup else 0
        exit_code, error_kind, detail = self._classify(status, timed_out, stderr, timeout_s, oom_kills)
        return SandboxResult(
            stdout=stdout,
            stderr=stderr,
            exit_code=exit_code,
            timed_out=timed_out,
            error_kind=error_kind,
            wall_s=wall_s,
            stdout_truncated=stdout_truncated,
            stderr_truncated=stderr_truncated,
            detail=detail,
            process_group=process.pid,
        )

    @staticmethod
    def _track_init(run: _Run, status: bytes) -> None:
        """As soon as bwrap names the PID namespace's init: a pidfd on it and a hold on its mount namespace."""
        for document in _json_documents(status):
            pid, namespace = document.get("child-pid"), document.get("pid-namespace")
            if not isinstance(pid, int) or pid <= 0:
                continue
            try:
                pidfd = os.pidfd_open(pid)
            except OSError:
                return  # already gone (then so is its namespace)
            try:
                # Same process still? (Its pid could in theory have been reused since bwrap wrote it.)
                same = namespace is None or os.stat(f"/proc/{pid}/ns/pid").st_ino == namespace
            except OSError:
                same = False
            if not same:
                os.close(pidfd)
                return
            run.init_pidfd = pidfd
            try:
                mount_ns = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return  # gone already, or not ours to open: then the last process unmounts, on its way out
            try:
                signal.pidfd_send_signal(pidfd, 0)  # alive after the open: the namespace is the run's
                run.mount_ns_fd = mount_ns
            except OSError:
                os.close(mount_ns)
            return

    @staticmethod
    def _kill(run: _Run) -> None:
        """SIGKILL the run without waiting: the namespace's init (the kernel then kills every process in it),
        and bwrap's process group while bwrap is not yet reaped (so its pid cannot have been reused)."""
        if run.init_pidfd is not None:
            try:
                signal.pidfd_send_signal(run.init_pidfd, signal.SIGKILL)
            except OSError:
                pass  # already exited
        process = run.process
        if process is not None and process.poll() is None:
            _kill_group(process.pid)

    def _teardown(self, run: _Run, slot: int) -> None:
        """Release everything of the run (own thread; never raises), then give its slot back."""
        problems = []
        try:
            self._kill(run)
            if run.process is not None:
                try:
                    run.process.wait(timeout=5.0)
                except subprocess.TimeoutExpired:
                    problems.append(f"bwrap (pid {run.process.pid}) did not exit 5 s after SIGKILL")
                for stream in (run.process.stdout, run.process.stderr):
                    if stream is not None:
                        stream.close()
            namespace_gone = True
            if run.init_pidfd is not None:
                # The pidfd turns readable once the init has exited, and an init exits only after the
                # kernel has killed and released every other process of its PID namespace.
                poller = select.poll()  # not select.select: fds above 1024 are common in a trainer
                poller.register(run.init_pidfd, select.POLLIN)
                if not poller.poll(5000):
                    namespace_gone = False
                    problems.append("the sandbox's PID namespace is still alive 5 s after SIGKILL")
                os.close(run.init_pidfd)
                run.init_pidfd = None
            if run.mount_ns_fd is not None:
                os.close(run.mount_ns_fd)  # the last reference: the run's tmpfs mounts go now (may take seconds)
                run.mount_ns_fd = None
            if namespace_gone:  # every process of the run is gone: what it left in flight is garbage
                _release_files_in_flight(run.cgroup)
            if run.cgroup is not None:
                error = run.cgroup.remove(timeout_s=2.0)
                if error:
                    problems.append(error)
        except Exception as exc:  # noqa: BLE001
            problems.append(f"{type(exc).__name__}: {exc}")
        for fd in run.fds:
            try:
                os.close(fd)
            except OSError:
                pass
        run.fds.clear()
        with self._slots_changed:
            run.cleanup_error = "; ".join(problems) or None
            run.finished = True
            late_failure = run.detached and run.cleanup_error
            if late_failure:
                self.teardown_errors.append(run.cleanup_error)
        if late_failure:
            logger.warning("LocalSandbox: teardown after the result incomplete: %s", run.cleanup_error)
        self._give_slot(slot)

    @staticmethod
    def _classify(status: dict[str, Any], timed_out: bool, stderr: str, timeout_s: float,
                  oom_kills: int) -> tuple[int | None, str | None, str | None]:
        """``(exit_code, error_kind, detail)`` from bwrap's and the launcher's reports and the cgroup's OOM count."""
        raw = status.get("exit-code")
        exit_code: int | None = raw if isinstance(raw, int) else None
        signal_number = None
        if exit_code is not None and 128 < exit_code <= 128 + 64:
            signal_number = exit_code - 128  # bwrap's convention for "killed by signal N"
            exit_code = -signal_number
        if oom_kills:  # first: whatever else happened (no status, a timeout) followed from the overrun
            return exit_code, "memory", f"memory limit of the run exceeded ({oom_kills} process(es) OOM-killed)"
        if timed_out:  # whatever status bwrap saw was our own SIGKILL
            return None, "timeout", f"wall-clock limit of {timeout_s:g} s exceeded"
        if status.get("setup_error"):
            return None, "sandbox_error", str(status["setup_error"])
        if exit_code is None:
            tail = stderr.strip()[-500:]
            return None, "sandbox_error", f"the sandbox did not start the program: {tail or 'no report'}"
        if signal_number:
            if signal_number == signal.SIGXCPU:
                return exit_code, "cpu_limit", "CPU time limit exceeded"
            if signal_number == signal.SIGXFSZ:
                return exit_code, "file_size", "file size limit exceeded"
            try:
                name = signal.Signals(signal_number).name
            except ValueError:
                name = f"signal {signal_number}"
            return exit_code, "killed", f"killed by {name}"
        if exit_code != 0:
            last_line = next((line for line in reversed(stderr.splitlines()) if line.strip()), "")
            if last_line.startswith("MemoryError"):
                return exit_code, "memory", "memory limit exceeded (MemoryError)"
            return exit_code, "runtime_error", None
        return 0, None, None


def _collect_unix_garbage(timeout_s: float) -> bool:
    """Run the kernel's garbage collector of in-flight Unix-socket files and wait (at most ``timeout_s``)
    until a collection that started after this call is over. True when it was seen to finish.

    The collector runs on a kernel worker when some Unix socket is closed while files are in flight. To
    see it finish, a marker of garbage is made here: a socket queued on itself together with a pipe's
    write end. The pass that frees the marker closes that write end (EOF on the read end), and it also
    freed every cycle that was garbage before the marker was made.
    """
    read_end, write_end = os.pipe()
    try:
        first, second = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            socket.send_fds(first, [b"m"], [second.fileno(), write_end])
        finally:
            os.close(write_end)
            second.close()  # now held only by its own queue: garbage
            first.close()  # its release, with files in flight, queues a collection (which sees `second` dead)
        poller = select.poll()
        poller.register(read_end, select.POLLIN)
        return bool(poller.poll(max(1, int(timeout_s * 1000))))
    finally:
        os.close(read_end)


def _release_files_in_flight(cgroup: cgroups.RunCgroup | None) -> None:
    """Free files the dead run left only in flight in its own Unix sockets (an SCM_RIGHTS cycle: a socket
    queued on itself with memfds beside it), so ``run()`` returns with the run's memory given back.

    No process refers to such files any more, but the kernel frees them only when its unix GC runs, and
    that runs when some Unix socket somewhere is closed (seconds later on a quiet host). Here the GC is
    run and waited for (:func:`_collect_unix_garbage`); with a memory cgroup also until the run's shared
    memory is gone (the last files are released by a kernel worker just after the pass), all within
    ``_GC_WAIT_S``.
    """
    deadline = time.monotonic() + _GC_WAIT_S
    _collect_unix_garbage(_GC_WAIT_S)
    if cgroup is None:
        return
    while cgroup.shmem_bytes() and time.monotonic() < deadline:
        time.sleep(0.005)


def _memory_file(name: str, data: bytes, run: _Run) -> int:
    """An anonymous memory file holding ``data``, positioned at its start (closed with the run)."""
    fd = os.memfd_create(name)
    run.fds.append(fd)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
