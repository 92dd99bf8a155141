"""The seccomp filter every LocalSandbox run gets (bwrap ``--seccomp FD``), built with libseccomp.

An allowlist, like Docker's default profile: a syscall runs only when it is in :data:`ALLOWED` (with its
argument conditions); everything else answers ``EPERM``, and numbers newer than this libseccomp's table
(and ``clone3``, whose flags a filter cannot read) answer ``ENOSYS`` so that libc falls back. Other ABIs
of the machine (x32, i386 on x86-64) kill the process. The allowed set is what CPython, its standard
library, numpy and sympy use (traced with ``strace -f`` on the ReTool programs, numpy, sympy,
multiprocessing, threads, subprocess and asyncio; see docs/tasks.md), within Docker's list, minus the
calls that read or steer state shared with other runs through the read-only host files (inotify,
fanotify, dnotify, ``posix_fadvise``, ``readahead``, ``mincore``, ``cachestat``, locks) or the host as a
whole (``sync``, ``syncfs``).

Every argument condition compares the bits the kernel reads: an ``int`` argument is masked to its low 32
bits (``socket(0x100000028, ...)`` is ``socket(AF_VSOCK, ...)`` to the kernel, and refused here too).

Details: docs/tasks.md (Code sandbox: the seccomp filter).
"""

from __future__ import annotations

import errno
import os
from typing import Any

__all__ = ["ALLOWED", "CLONE_NAMESPACE_FLAGS", "DENIED", "FCNTL_COMMANDS", "SOCKET_FAMILIES",
           "SeccompUnavailableError", "build_program", "syscall_number"]

# Allowed without conditions, by purpose (names this architecture lacks are skipped).
ALLOWED: dict[str, tuple[str, ...]] = {
    "processes and threads": (
        "exit", "exit_group", "fork", "vfork", "execve", "execveat", "wait4", "waitid", "kill", "tkill", "tgkill",
        "getpid", "getppid", "gettid", "getpgid", "getpgrp", "getsid", "setpgid", "setsid", "set_tid_address",
        "set_robust_list", "get_robust_list", "rseq", "futex", "futex_waitv", "futex_wake", "futex_wait",
        "futex_requeue", "restart_syscall", "arch_prctl", "prctl", "getcpu", "pidfd_open", "pidfd_send_signal",
        "sched_yield", "sched_getaffinity", "sched_setaffinity", "sched_getparam", "sched_setparam",
        "sched_getscheduler", "sched_setscheduler", "sched_get_priority_max", "sched_get_priority_min",
        "sched_rr_get_interval", "sched_getattr", "sched_setattr", "getpriority", "setpriority",
        "ioprio_get", "ioprio_set",
    ),
    "identity and limits": (
        "getuid", "geteuid", "getgid", "getegid", "getresuid", "getresgid", "getgroups", "setuid", "setgid",
        "setreuid", "setregid", "setresuid", "setresgid", "setgroups", "setfsuid", "setfsgid", "capget", "capset",
        "getrlimit", "setrlimit", "prlimit64", "getrusage", "times", "umask", "uname",
        # the host's memory and load (as in /proc): glibc's sysconf(_SC_PHYS_PAGES) and qsort read it and
        # use garbage when it fails; the channel it carries is bounded in docs/tasks.md
        "sysinfo",
    ),
    "memory": (
        "brk", "mmap", "munmap", "mprotect", "mremap", "madvise", "msync", "mlock", "mlock2", "munlock",
        "mlockall", "munlockall", "membarrier", "memfd_create", "pkey_alloc", "pkey_free", "pkey_mprotect",
        "map_shadow_stack",
    ),
    "signals and timers": (
        "rt_sigaction", "rt_sigprocmask", "rt_sigreturn", "rt_sigpending", "rt_sigsuspend", "rt_sigtimedwait",
        "rt_sigqueueinfo", "rt_tgsigqueueinfo", "sigaltstack", "signalfd", "signalfd4", "pause", "alarm",
        "getitimer", "setitimer", "timer_create", "timer_delete", "timer_gettime", "timer_settime",
        "timer_getoverrun", "timerfd_create", "timerfd_gettime", "timerfd_settime", "clock_gettime",
        "clock_getres", "clock_nanosleep", "nanosleep", "gettimeofday", "time",
    ),
    "files": (
        "read", "write", "readv", "writev", "pread64", "pwrite64", "preadv", "pwritev", "preadv2", "pwritev2",
        "open", "openat", "openat2", "creat", "close", "close_range", "dup", "dup2", "dup3", "lseek", "stat",
        "fstat", "lstat", "newfstatat", "statx", "statfs", "fstatfs", "access", "faccessat", "faccessat2",
        "getcwd", "chdir", "fchdir", "mkdir", "mkdirat", "rmdir", "unlink", "unlinkat", "rename", "renameat",
        "renameat2", "link", "linkat", "symlink", "symlinkat", "readlink", "readlinkat", "chmod", "fchmod",
        "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat", "truncate", "ftruncate", "fallocate",
        "fsync", "fdatasync", "getdents", "getdents64", "utime", "utimes", "utimensat", "futimesat", "mknod",
        "mknodat", "copy_file_range", "sendfile", "splice", "tee", "vmsplice", "ioctl", "getxattr",
        "lgetxattr", "fgetxattr", "listxattr", "llistxattr", "flistxattr", "setxattr", "lsetxattr",
        "fsetxattr", "removexattr", "lremovexattr", "fremovexattr",
    ),
    "pipes and polling": (
        "pipe", "pipe2", "eventfd", "eventfd2", "epoll_create", "epoll_create1", "epoll_ctl", "epoll_wait",
        "epoll_pwait", "epoll_pwait2", "poll", "ppoll", "select", "pselect6",
    ),
    "sockets (socket and socketpair: see SOCKET_FAMILIES)": (
        "bind", "listen", "accept", "accept4", "connect", "getsockname", "getpeername", "sendto", "recvfrom",
        "sendmsg", "recvmsg", "sendmmsg", "recvmmsg", "shutdown", "setsockopt", "getsockopt",
    ),
    "System V and POSIX IPC (the run's own IPC namespace)": (
        "msgget", "msgsnd", "msgrcv", "msgctl", "semget", "semop", "semtimedop", "semctl", "shmget", "shmat",
        "shmdt", "shmctl", "mq_open", "mq_unlink", "mq_timedsend", "mq_timedreceive", "mq_notify",
        "mq_getsetattr",
    ),
    "randomness": ("getrandom",),
}
# Refused by name for a reason (all are outside ALLOWED anyway; the docs list the same groups).
DENIED: dict[str, tuple[str, ...]] = {
    "namespaces": ("unshare", "setns"),
    "keyrings": ("keyctl", "add_key", "request_key"),
    "io_uring and aio": ("io_uring_setup", "io_uring_enter", "io_uring_register", "io_setup", "io_submit",
                         "io_getevents", "io_pgetevents", "io_cancel", "io_destroy"),
    "tracing and bpf": ("userfaultfd", "perf_event_open", "bpf"),
    "mounts": ("mount", "umount", "umount2", "pivot_root", "chroot", "move_mount", "open_tree", "fsopen",
               "fsmount", "fsconfig", "fspick", "mount_setattr"),
    "other processes": ("ptrace", "process_vm_readv", "process_vm_writev", "process_madvise", "pidfd_getfd",
                        "kcmp"),
    "file handles": ("name_to_handle_at", "open_by_handle_at"),
    "machine state": ("reboot", "kexec_load", "kexec_file_load", "init_module", "finit_module", "delete_module",
                      "create_module", "query_module", "get_kernel_syms", "acct", "swapon", "swapoff", "syslog",
                      "quotactl", "quotactl_fd", "settimeofday", "clock_settime", "clock_adjtime", "adjtimex",
                      "stime", "sethostname", "setdomainname", "vhangup", "iopl", "ioperm", "lookup_dcookie",
                      "nfsservctl", "uselib", "ustat", "sysfs", "_sysctl", "vm86", "vm86old", "modify_ldt"),
    "numa policy": ("mbind", "set_mempolicy", "set_mempolicy_home_node", "get_mempolicy", "migrate_pages",
                    "move_pages"),
    # shared host files: their page cache and access events are seen by every run and by the host
    "file watches and page-cache probes": ("inotify_init", "inotify_init1", "inotify_add_watch",
                                           "inotify_rm_watch", "fanotify_init", "fanotify_mark", "fadvise64",
                                           "readahead", "mincore", "cachestat", "remap_file_pages"),
    # sync/syncfs flush every file system of the host: a stall for others and a timing probe
    "whole-host flushes": ("sync", "syncfs"),
    # locks on a shared file are seen by other runs: flock, and fcntl's lock commands (FCNTL_COMMANDS)
    "locks (ENOLCK)": ("flock",),
}
# clone(2) flags that create a namespace (CLONE_NEWTIME only exists for clone3/unshare)
CLONE_NAMESPACE_FLAGS = {
    "CLONE_NEWNS": 0x00020000, "CLONE_NEWCGROUP": 0x02000000, "CLONE_NEWUTS": 0x04000000,
    "CLONE_NEWIPC": 0x08000000, "CLONE_NEWUSER": 0x10000000, "CLONE_NEWPID": 0x20000000,
    "CLONE_NEWNET": 0x40000000,
}
# socket(2)/socketpair(2) families a run may create: local sockets, IP on the run's own (empty) network
# namespace, and netlink's NETLINK_ROUTE only (getaddrinfo and if_nameindex ask it for the run's own
# addresses; not NETLINK_KOBJECT_UEVENT, whose broadcasts are the host's device events, nor audit and the
# rest). Not AF_VSOCK (reaches a VM's host across network namespaces), AF_PACKET, AF_ALG and the rest.
# socketpair only makes sense for AF_UNIX.
SOCKET_FAMILIES = {"AF_UNIX": 1, "AF_INET": 2, "AF_INET6": 10}
_AF_NETLINK, _NETLINK_ROUTE = 16, 0
_SOCKETPAIR_FAMILIES = {"AF_UNIX": 1}
# fcntl(2) commands a run may use. Refused: the lock commands (F_GETLK 5, F_SETLK 6, F_SETLKW 7,
# F_OFD_GETLK 36, F_OFD_SETLK 37, F_OFD_SETLKW 38) answer ENOLCK like a file system without locks; leases
# (1024, 1025) and F_NOTIFY (1026, dnotify: events on the host's directories) answer EPERM.
FCNTL_COMMANDS = {
    "F_DUPFD": 0, "F_GETFD": 1, "F_SETFD": 2, "F_GETFL": 3, "F_SETFL": 4, "F_SETOWN": 8, "F_GETOWN": 9,
    "F_SETSIG": 10, "F_GETSIG": 11, "F_SETOWN_EX": 15, "F_GETOWN_EX": 16, "F_DUPFD_CLOEXEC": 1030,
    "F_SETPIPE_SZ": 1031, "F_GETPIPE_SZ": 1032, "F_ADD_SEALS": 1033, "F_GET_SEALS": 1034,
}
_FCNTL_LOCK_COMMANDS = (5, 6, 7, 36, 37, 38)
# personality(2) values Docker's profile allows: PER_LINUX, PER_LINUX32, UNAME26 (and with PER_LINUX32),
# and 0xffffffff (query); never ADDR_NO_RANDOMIZE or READ_IMPLIES_EXEC.
_PERSONALITIES = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)
_INT_MASK = 0xFFFFFFFF  # the kernel reads an int argument's low 32 bits; the filter compares the same bits
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


def _int_equals(library: Any, index: int, value: int) -> Any:
    """Condition "argument ``index``, read as the kernel reads an int (its low 32 bits), equals ``value``"."""
    return library.Arg(index, library.MASKED_EQ, _INT_MASK, value & _INT_MASK)


def build_program() -> tuple[bytes, dict[str, Any]]:
    """``(BPF program for bwrap --seccomp, summary)``; the summary lists what is allowed and what is refused
    by name on this architecture.

    Raises:
        SeccompUnavailableError: libseccomp or its binding is missing, or refuses a rule.
    """
    library = _library()
    allow, refuse = library.ALLOW, library.ERRNO(errno.EPERM)
    try:
        rules = library.SyscallFilter(refuse)
        rules.set_attr(library.Attr.ACT_BADARCH, library.KILL_PROCESS)
        allowed: list[str] = []
        for names in ALLOWED.values():
            for name in names:
                if syscall_number(name) is not None:
                    rules.add_rule(allow, name)
                    allowed.append(name)
        refused = [name for names in DENIED.values() for name in names if syscall_number(name) is not None]
        if "flock" in refused:
            rules.add_rule(library.ERRNO(errno.ENOLCK), "flock")
        # clone without a namespace flag (threads, fork, vfork); the flags are the low 32 bits
        namespace_mask = sum(CLONE_NAMESPACE_FLAGS.values())
        rules.add_rule(allow, "clone", library.Arg(0, library.MASKED_EQ, namespace_mask, 0))
        if syscall_number("clone3") is not None:
            rules.add_rule(library.ERRNO(errno.ENOSYS), "clone3")
        for family in SOCKET_FAMILIES.values():
            rules.add_rule(allow, "socket", _int_equals(library, 0, family))
        rules.add_rule(allow, "socket", _int_equals(library, 0, _AF_NETLINK), _int_equals(library, 2, _NETLINK_ROUTE))
        for family in _SOCKETPAIR_FAMILIES.values():
            rules.add_rule(allow, "socketpair", _int_equals(library, 0, family))
        for command in FCNTL_COMMANDS.values():
            rules.add_rule(allow, "fcntl", _int_equals(library, 1, command))
        for command in _FCNTL_LOCK_COMMANDS:
            rules.add_rule(library.ERRNO(errno.ENOLCK), "fcntl", _int_equals(library, 1, command))
        for persona in _PERSONALITIES:
            rules.add_rule(allow, "personality", _int_equals(library, 0, persona))
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
    summary = {"allowed": allowed, "refused": refused, "clone_flags": sorted(CLONE_NAMESPACE_FLAGS),
               "socket_families": [*sorted(SOCKET_FAMILIES), "AF_NETLINK/NETLINK_ROUTE"], "fcntl_commands": sorted(FCNTL_COMMANDS),
               "enosys": ["clone3"], "unknown_enosys": [highest + 1, highest + _UNKNOWN_SPAN],
               "instructions": len(program) // 8}
    return program, summary
