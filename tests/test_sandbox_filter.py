"""The seccomp program itself, run on a classic-BPF interpreter (issue 39, findings 1, 3 and 4).

The kernel runs the same program in root and non-root modes (``--seccomp FD`` in both), so checking the
program checks both. Decisions are read as the kernel gives them: the syscall number, the architecture,
and six 64-bit argument registers of which an ``int`` argument's kernel code reads the low 32 bits.
"""

from __future__ import annotations

import errno
import platform
import random
import struct

import pytest

from async_rl.sandbox import syscall_filter

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="syscall numbers and ABIs of x86-64")

AUDIT_ARCH_X86_64 = 0xC000003E
AUDIT_ARCH_I386 = 0x40000003
X32_SYSCALL_BIT = 0x40000000
ALLOW = 0x7FFF0000
KILL_PROCESS = 0x80000000


def errno_action(number: int) -> int:
    return 0x00050000 | number


@pytest.fixture(scope="module")
def program():
    return syscall_filter.build_program()[0]


def decide(program: bytes, nr: int, args=(), arch: int = AUDIT_ARCH_X86_64) -> int:
    """The filter's return value for one syscall (a classic-BPF interpreter, the subset seccomp allows)."""
    registers = [value & (2**64 - 1) for value in args] + [0] * (6 - len(args))
    data = struct.pack("<iIQ6Q", nr, arch, 0, *registers)
    instructions = [struct.unpack_from("<HBBI", program, offset) for offset in range(0, len(program), 8)]
    accumulator = index = pc = 0
    memory = [0] * 16
    while True:
        code, jump_true, jump_false, k = instructions[pc]
        pc += 1
        kind = code & 0x07
        if code == 0x20:  # ld [k]
            accumulator = struct.unpack_from("<I", data, k)[0]
        elif code == 0x00:  # ld #k
            accumulator = k
        elif code == 0x60:  # ld M[k]
            accumulator = memory[k]
        elif code == 0x61:  # ldx M[k]
            index = memory[k]
        elif code == 0x01:  # ldx #k
            index = k
        elif code == 0x02:  # st M[k]
            memory[k] = accumulator
        elif code == 0x03:  # stx M[k]
            memory[k] = index
        elif code == 0x07:  # tax
            index = accumulator
        elif code == 0x87:  # txa
            accumulator = index
        elif kind == 0x04:  # alu
            operand = index if code & 0x08 else k
            operation = code & 0xF0
            accumulator = {0x00: lambda a: a + operand, 0x10: lambda a: a - operand, 0x50: lambda a: a & operand,
                           0x40: lambda a: a | operand, 0x60: lambda a: a << operand, 0x70: lambda a: a >> operand,
                           0xA0: lambda a: a ^ operand}[operation](accumulator) & 0xFFFFFFFF
        elif kind == 0x05:  # jumps
            operation = code & 0xF0
            if operation == 0x00:
                pc += k
                continue
            operand = index if code & 0x08 else k
            taken = {0x10: accumulator == operand, 0x20: accumulator > operand, 0x30: accumulator >= operand,
                     0x40: bool(accumulator & operand)}[operation]
            pc += jump_true if taken else jump_false
        elif kind == 0x06:  # ret
            return accumulator if code & 0x10 else k
        else:
            raise AssertionError(f"unexpected BPF instruction {code:#x}")


def nr(name: str) -> int:
    number = syscall_filter.syscall_number(name)
    assert number is not None, name
    return number


def test_socket_family_is_read_as_the_kernel_reads_it(program):
    socket = nr("socket")
    refused = errno_action(errno.EPERM)
    # the measured bypass: both spell AF_VSOCK (40) in the low 32 bits
    assert decide(program, socket, (40, 1, 0)) == refused
    assert decide(program, socket, (0x100000028, 1, 0)) == refused
    assert decide(program, socket, (-0xFFFFFFD8, 1, 0)) == refused
    assert decide(program, socket, (17, 3, 0)) == refused  # AF_PACKET
    assert decide(program, socket, (38, 5, 0)) == refused  # AF_ALG
    # high bits the kernel ignores do not turn an allowed family into a refused one either
    for family in syscall_filter.SOCKET_FAMILIES.values():
        assert decide(program, socket, (family, 1, 0)) == ALLOW
        assert decide(program, socket, (family | 0xABCD << 32, 1, 0)) == ALLOW
    assert decide(program, socket, (16, 3, 0)) == ALLOW  # AF_NETLINK, NETLINK_ROUTE (getaddrinfo)
    assert decide(program, socket, (16 | 7 << 32, 3, 0 | 9 << 32)) == ALLOW
    assert decide(program, socket, (16, 3, 15)) == refused  # NETLINK_KOBJECT_UEVENT: the host's device events
    assert decide(program, socket, (16, 3, 9)) == refused  # NETLINK_AUDIT
    assert decide(program, nr("socketpair"), (1, 1, 0, 0)) == ALLOW
    assert decide(program, nr("socketpair"), (40 | 1 << 32, 1, 0, 0)) == refused


CONDITIONAL = {  # syscall -> (argument index, values worth trying)
    "socket": (0, [0, 1, 2, 10, 16, 17, 38, 40, 44]),
    "socket ": (2, [0, 9, 15, 16]),  # the protocol, with AF_NETLINK set below
    "socketpair": (0, [1, 2, 40]),
    "fcntl": (1, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 15, 16, 36, 37, 38, 1024, 1025, 1026, 1030, 1031, 1032,
                  1033, 1034, 1035, 2048]),
    "personality": (0, [0, 8, 0x20000, 0x20008, 0x40000, 0x400000, 0xFFFFFFFF]),
    "clone": (0, [17, 0x3D0F00, 0x10000000 | 17, 0x20000, 0x40000000, 0x7E020000]),
}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_every_argument_condition_ignores_the_bits_the_kernel_ignores(program, seed):
    rng = random.Random(seed)
    for name, (position, values) in CONDITIONAL.items():
        for value in values:
            args = [rng.getrandbits(64) for _ in range(6)]
            if name == "socket ":
                args[0] = 16 | rng.getrandbits(32) << 32
            args[position] = value
            expected = decide(program, nr(name.strip()), args)
            for _ in range(8):
                args[position] = value | rng.getrandbits(32) << 32
                assert decide(program, nr(name.strip()), args) == expected, (name, hex(value), hex(args[position]))


def test_fcntl_commands_channels_and_locks(program):
    fcntl = nr("fcntl")
    for command in (1, 2, 3, 4, 1030):  # what CPython uses
        assert decide(program, fcntl, (3, command, 0)) == ALLOW
    for command in (5, 6, 7, 36, 37, 38):  # locks: a channel through shared files
        assert decide(program, fcntl, (3, command, 0)) == errno_action(errno.ENOLCK)
    assert decide(program, fcntl, (3, 1026, 0)) == errno_action(errno.EPERM)  # F_NOTIFY (dnotify)
    assert decide(program, fcntl, (3, 1024, 0)) == errno_action(errno.EPERM)  # F_SETLEASE
    assert decide(program, nr("flock"), (3, 2)) == errno_action(errno.ENOLCK)


def test_default_is_refusal_and_the_named_channels_are_refused(program):
    refused = errno_action(errno.EPERM)
    for name in ("inotify_init1", "inotify_add_watch", "fanotify_init", "fanotify_mark", "fadvise64", "readahead",
                 "mincore", "sync", "syncfs", "io_setup", "keyctl", "ptrace", "unshare", "mbind", "kcmp"):
        assert decide(program, nr(name), (0, 0, 0)) == refused, name
    assert decide(program, nr("clone3"), ()) == errno_action(errno.ENOSYS)
    newer = syscall_filter.build_program()[1]["unknown_enosys"][0]  # newer than libseccomp: libc falls back
    assert decide(program, newer, ()) == errno_action(errno.ENOSYS)
    for names in syscall_filter.ALLOWED.values():
        for name in names:
            if syscall_filter.syscall_number(name) is not None:
                assert decide(program, nr(name), (0, 0, 0)) == ALLOW, name


def test_other_abis_are_killed(program):
    assert decide(program, 1, (1, 0, 0), arch=AUDIT_ARCH_I386) == KILL_PROCESS  # i386 via int 0x80
    assert decide(program, X32_SYSCALL_BIT | 41, (40, 1, 0)) == KILL_PROCESS  # x32 socket
    assert decide(program, X32_SYSCALL_BIT | 1, (1, 0, 0)) == KILL_PROCESS  # x32 write
