"""A seccomp filter for the sandbox: refuses the system calls that a test program never needs
and that widen what it can reach (debugging other processes, kernel keyrings, BPF, io_uring,
mounts, new namespaces, kernel modules).

The filter is a classic BPF program, written here without libseccomp, in the binary form that
bubblewrap's `--seccomp FD` reads: an array of `struct sock_filter {u16 code; u8 jt; u8 jf;
u32 k;}`. Refused calls fail with EPERM; a call through another ABI than the native one (i386
`int 0x80`, x32) kills the process. Only x86_64 has a table; elsewhere `filter_program()`
returns None and the sandbox runs without a filter (and says so).
"""
from __future__ import annotations

import errno
import os
import platform
import struct

# the x86_64 system call numbers (arch/x86/entry/syscalls/syscall_64.tbl)
REFUSED_X86_64 = {
    "ptrace": 101, "acct": 163, "mount": 165, "umount2": 166, "pivot_root": 155, "swapon": 167,
    "swapoff": 168, "reboot": 169, "sethostname": 170, "setdomainname": 171, "init_module": 175,
    "delete_module": 176, "quotactl": 179, "lookup_dcookie": 212, "kexec_load": 246, "add_key": 248,
    "request_key": 249, "keyctl": 250, "unshare": 272, "move_pages": 279, "perf_event_open": 298,
    "name_to_handle_at": 303, "open_by_handle_at": 304, "setns": 308, "process_vm_readv": 310,
    "process_vm_writev": 311, "kcmp": 312, "finit_module": 313, "kexec_file_load": 320, "bpf": 321,
    "userfaultfd": 323, "io_uring_setup": 425, "io_uring_enter": 426, "io_uring_register": 427,
    "open_tree": 428, "move_mount": 429, "fsopen": 430, "fsconfig": 431, "fsmount": 432, "fspick": 433,
    "pidfd_getfd": 438, "mount_setattr": 442,
}
AUDIT_ARCH_X86_64 = 0xC000003E
X32_SYSCALL_BIT = 0x40000000

_LD_W_ABS, _JEQ_K, _JGE_K, _RET_K = 0x20, 0x15, 0x35, 0x06
_RET_ALLOW, _RET_KILL_PROCESS = 0x7FFF0000, 0x80000000
_RET_EPERM = 0x00050000 | errno.EPERM
_OFFSET_NR, _OFFSET_ARCH = 0, 4  # struct seccomp_data {int nr; u32 arch; ...}


def _insn(code: int, k: int, jt: int = 0, jf: int = 0) -> bytes:
    return struct.pack("=HBBI", code, jt, jf, k)


def filter_program() -> bytes | None:
    """The BPF program for this machine, or None where there is no table for its architecture."""
    if platform.machine() != "x86_64":
        return None
    numbers = sorted(set(REFUSED_X86_64.values()))
    n = len(numbers)
    # layout: 0 ld arch | 1 jeq native | 2 ret kill | 3 ld nr | 4 jge x32 | 5.. jeq nr_i | allow | eperm
    program = [
        _insn(_LD_W_ABS, _OFFSET_ARCH),
        _insn(_JEQ_K, AUDIT_ARCH_X86_64, jt=1, jf=0),
        _insn(_RET_K, _RET_KILL_PROCESS),
        _insn(_LD_W_ABS, _OFFSET_NR),
        _insn(_JGE_K, X32_SYSCALL_BIT, jt=n + 1, jf=0),  # to eperm: over the n tests and allow
    ]
    for i, number in enumerate(numbers):
        program.append(_insn(_JEQ_K, number, jt=n - i, jf=0))  # to eperm
    program += [_insn(_RET_K, _RET_ALLOW), _insn(_RET_K, _RET_EPERM)]
    return b"".join(program)


def filter_fd() -> int | None:
    """A readable file descriptor holding the filter (for bwrap --seccomp), or None."""
    program = filter_program()
    if program is None:
        return None
    fd = os.memfd_create("megagrpo-seccomp")
    os.write(fd, program)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd
