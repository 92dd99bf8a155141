"""The seccomp filter every LocalSandbox run gets (bwrap ``--seccomp FD``), built with libseccomp.

libseccomp (its own ``seccomp`` binding, else ``pyseccomp``) emits the BPF, resolves names per
architecture and kills foreign ABIs. Policy: allow by default, refuse what Docker's default profile refuses
a container without extra capabilities (new namespaces, keyrings, io_uring, userfaultfd, perf_event_open,
bpf, mounts, other processes' memory, file handles, machine state, NUMA policy, some ``personality`` flags,
``AF_VSOCK``), with ``EPERM``; ``clone3`` and syscalls newer than the library answer ``ENOSYS``.

Details: docs/tasks.md (Code sandbox: the seccomp filter).
"""

from __future__ import annotations

import errno
import os
from typing import Any

__all__ = ["CLONE_NAMESPACE_FLAGS", "DENIED", "SeccompUnavailableError", "build_program", "syscall_number"]

# name groups, as in the module docstring (one table: the docs in docs/tasks.md list the same groups)
DENIED: dict[str, tuple[str, ...]] = {
    "namespaces": ("unshare", "setns"),
    "keyrings": ("keyctl", "add_key", "request_key"),
    "io_uring": ("io_uring_setup", "io_uring_enter", "io_uring_register"),
    "tracing and bpf": ("userfaultfd", "perf_event_open", "bpf"),
    "mounts": ("mount", "umount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
               "fsmount", "fsconfig", "fspick", "mount_setattr"),
    "other processes": ("ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd",
                        "kcmp"),
    "file handles": ("name_to_handle_at", "open_by_handle_at"),
    "machine state": ("reboot", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
                      "create_module", "query_module", "get_kernel_syms", "acct", "swapon", "swapoff", "syslog",
                      "quotactl", "quotactl_fd", "settimeofday", "clock_settime", "clock_adjtime", "stime",
                      "sethostname", "setdomainname", "vhangup", "iopl", "ioperm", "fanotify_init",
                      "lookup_dcookie", "nfsservctl", "uselib", "ustat", "sysfs", "_sysctl", "vm86", "vm86old"),
    "numa policy": ("mbind", "set_mempolicy", "set_mempolicy_home_node", "get_mempolicy", "migrate_pages",
                    "move_pages"),
}
# clone(2) flags that create a namespace (CLONE_NEWTIME only exists for clone3/unshare)
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
_PERSONALITY_FLAGS = {"ADDR_NO_RANDOMIZE": 0x0040000, "READ_IMPLIES_EXEC": 0x0400000}
_AF_VSOCK = 40
_UNKNOWN_SPAN = 128  # numbers past the last known syscall that answer ENOSYS
_HIGHEST_PROBED = 2048


class SeccompUnavailableError(RuntimeError):
    """libseccomp or a Python binding for it is missing (the message names what to install)."""


def _library() -> Any:
    try:
        import seccomp  # libseccomp's own binding (Debian: python3-seccomp)
        return seccomp
    except ImportError:
        pass
    try:
        import pyseccomp  # ctypes binding with the same API (PyPI)
    except ImportError:
        raise SeccompUnavailableError(
            "LocalSandbox builds its seccomp filter with libseccomp, but no binding is importable. Fix: "
            "pip install pyseccomp (a dependency of this project: pip install -e .) and apt-get install "
            "libseccomp2"
        ) from None
    except (OSError, RuntimeError) as exc:  # pyseccomp raises when libseccomp.so.2 cannot be found
        raise SeccompUnavailableError(
            f"libseccomp cannot be loaded ({exc}). Fix: apt-get install libseccomp2 (make sandbox-deps)"
        ) from None
    return pyseccomp


def syscall_number(name: str) -> int | None:
    """The native number of ``name``, or None when it does not exist on this architecture."""
    library = _library()
    number = library.resolve_syscall(library.Arch.NATIVE, name)
    return number if isinstance(number, int) and number >= 0 else None


def _highest_known(library: Any) -> int:
    highest = -1
    for number in range(_HIGHEST_PROBED):
        try:
            library.resolve_syscall(library.Arch.NATIVE, number)
        except (ValueError, OSError):
            continue
        highest = number
    return highest


def build_program() -> tuple[bytes, dict[str, Any]]:
    """``(BPF program for bwrap --seccomp, summary)``; the summary lists what was refused on this architecture.

    Raises:
        SeccompUnavailableError: libseccomp or its binding is missing, or refuses a rule.
    """
    library = _library()
    native = library.Arch.NATIVE
    deny = library.ERRNO(errno.EPERM)
    try:
        rules = library.SyscallFilter(library.ALLOW)
        rules.set_attr(library.Attr.ACT_BADARCH, library.KILL_PROCESS)
        refused: list[str] = []
        for names in DENIED.values():
            for name in names:
                if syscall_number(name) is not None:
                    rules.add_rule(deny, name)
                    refused.append(name)
        for flag in CLONE_NAMESPACE_FLAGS.values():
            rules.add_rule(deny, "clone", library.Arg(0, library.MASKED_EQ, flag, flag))
        if syscall_number("clone3") is not None:
            rules.add_rule(library.ERRNO(errno.ENOSYS), "clone3")
        for flag in _PERSONALITY_FLAGS.values():
            rules.add_rule(deny, "personality", library.Arg(0, library.MASKED_EQ, flag, flag))
        rules.add_rule(deny, "socket", library.Arg(0, library.EQ, _AF_VSOCK))
        highest = _highest_known(library)
        for number in range(highest + 1, highest + 1 + _UNKNOWN_SPAN):
            rules.add_rule(library.ERRNO(errno.ENOSYS), number)
        read_end = os.memfd_create("seccomp-bpf")
        try:
            with os.fdopen(os.dup(read_end), "wb") as handle:
                rules.export_bpf(handle)
            os.lseek(read_end, 0, os.SEEK_SET)
            chunks = []
            while chunk := os.read(read_end, 1 << 16):
                chunks.append(chunk)
        finally:
            os.close(read_end)
    except OSError as exc:
        raise SeccompUnavailableError(f"libseccomp refused the sandbox's filter: {exc}") from None
    program = b"".join(chunks)
    if not program or len(program) % 8:
        raise SeccompUnavailableError(f"libseccomp exported a malformed BPF program ({len(program)} bytes)")
    summary = {"refused": refused, "clone_flags": sorted(CLONE_NAMESPACE_FLAGS), "enosys": ["clone3"],
               "unknown_enosys": [highest + 1, highest + _UNKNOWN_SPAN], "instructions": len(program) // 8}
    return program, summary
