"""Run a command with one system call refused by the kernel, as a seccomp sandbox would.

Usage: ``python tests/refuse_syscall.py SYSCALL ERRNO COMMAND [ARGS...]``

Installs a seccomp filter that makes every call of ``SYSCALL`` (``sendfile``) fail with
``ERRNO`` (a name, ``EPERM``) without running it, then execs ``COMMAND`` (same pid). The
filter is the kernel's own (``prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER)``), inherited by
every child and kept across exec; the process cannot lift it. Exits 2 where the machine
cannot install it (another architecture, or seccomp not permitted), before running
anything.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import struct
import sys

#: machine -> (AUDIT_ARCH_* of seccomp_data.arch, {system call name: number}).
ARCHES = {
    "x86_64": (0xC000003E, {"sendfile": 40}),
    "aarch64": (0xC00000B7, {"sendfile": 71}),
}
PR_SET_NO_NEW_PRIVS = 38
PR_SET_SECCOMP = 22
SECCOMP_MODE_FILTER = 2
SECCOMP_RET_ALLOW = 0x7FFF0000
SECCOMP_RET_ERRNO = 0x00050000
# Classic BPF opcodes: load a 32-bit word of seccomp_data, compare, return.
BPF_LD_W_ABS = 0x20
BPF_JEQ_K = 0x15
BPF_RET_K = 0x06
# Offsets in struct seccomp_data {int nr; __u32 arch; ...}.
NR_OFFSET = 0
ARCH_OFFSET = 4


class SockFprog(ctypes.Structure):
    """``struct sock_fprog``: the filter's length in instructions and its address."""

    _fields_ = (("len", ctypes.c_ushort), ("filter", ctypes.c_void_p))


def program(arch: int, number: int, error: int) -> bytes:
    """The filter: calls of ``number`` on ``arch`` fail with ``error``; all else runs."""
    instructions = [
        (BPF_LD_W_ABS, 0, 0, ARCH_OFFSET),
        (BPF_JEQ_K, 0, 3, arch),  # another ABI: allow (jump to the last instruction)
        (BPF_LD_W_ABS, 0, 0, NR_OFFSET),
        (BPF_JEQ_K, 0, 1, number),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ERRNO | error),
        (BPF_RET_K, 0, 0, SECCOMP_RET_ALLOW),
    ]
    return b"".join(struct.pack("=HBBI", *op) for op in instructions)


def install(name: str, error: int) -> None:
    """Refuse system call ``name`` with errno ``error`` in this process and its children.

    Raises:
        SystemExit: (status 2) unknown architecture or system call, or the kernel refused
            the filter.
    """
    arch, numbers = ARCHES.get(platform.machine(), (0, {}))
    if name not in numbers:
        sys.exit(f"refuse_syscall: no number for {name} on {platform.machine()}")
    code = program(arch, numbers[name], error)
    buffer = ctypes.create_string_buffer(code, len(code))
    prog = SockFprog(len(code) // 8, ctypes.addressof(buffer))
    libc = ctypes.CDLL(None, use_errno=True)
    # Without no_new_privs an unprivileged process may not install a filter.
    if libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        sys.exit(f"refuse_syscall: PR_SET_NO_NEW_PRIVS: {os.strerror(ctypes.get_errno())}")
    if libc.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
        sys.exit(f"refuse_syscall: PR_SET_SECCOMP: {os.strerror(ctypes.get_errno())}")


def main(argv: list[str]) -> None:
    """Install the filter named by ``argv[0:2]`` and exec ``argv[2:]``."""
    if len(argv) < 3:
        sys.exit(__doc__)
    name, error_name, command = argv[0], argv[1], argv[2:]
    error = getattr(errno, error_name, None)
    if not isinstance(error, int):
        sys.exit(f"refuse_syscall: unknown errno {error_name}")
    install(name, error)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
