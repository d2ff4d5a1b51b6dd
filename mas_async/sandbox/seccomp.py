"""The sandbox's seccomp filters, compiled to BPF by libseccomp (through `pyseccomp`, its ctypes binding).

Two filters, both "allow by default, refuse a list" (a deny list keeps every ordinary program working,
numpy and multiprocessing included, while closing what a program never needs and what attacks use):

- `SANDBOX`: given to bubblewrap (`--seccomp FD`), so it holds for every process of the sandbox, the
  zygote and each run's own setup included: no ptrace or access to another process's memory, no kernel
  keyring, no bpf or perf events, no io_uring (its operations bypass seccomp), no kernel modules,
  reboot or kexec, no userfaultfd, no file handles (open_by_handle_at reads files by inode, past the
  view), and no socket of a family other than AF_UNIX: no network, even should a namespace leak one.
- `PROGRAM`: `SANDBOX` and also what only the run's setup may do, loaded by the program's own process
  right before the program runs (`child.py`): no execve (a program runs no other program: no shell),
  no mount, umount, pivot_root or chroot, no new namespaces (unshare, setns, clone with a CLONE_NEW*
  flag; clone3 answers ENOSYS, so the C library falls back to clone, whose flags a filter can read),
  and no TIOCSTI (pushing input into a terminal).

A refused call fails with EPERM (EAFNOSUPPORT for a socket family), so the program sees an ordinary
OSError; a call of another architecture's ABI (x32, i386) kills the process.
"""

from __future__ import annotations

import errno
import functools
import os
import socket

SANDBOX_DENIED = (
    "ptrace", "process_vm_readv", "process_vm_writev", "kcmp", "pidfd_getfd",
    "add_key", "request_key", "keyctl",
    "bpf", "perf_event_open", "userfaultfd",
    "io_uring_setup", "io_uring_enter", "io_uring_register",
    "init_module", "finit_module", "delete_module", "kexec_load", "kexec_file_load",
    "reboot", "swapon", "swapoff", "syslog", "acct", "quotactl",
    "open_by_handle_at", "name_to_handle_at",
)  # fmt: skip
PROGRAM_DENIED = (
    "execve", "execveat",
    "mount", "umount2", "pivot_root", "chroot", "fsopen", "fsmount", "fspick", "move_mount", "open_tree",
    "mount_setattr", "unshare", "setns",
)  # fmt: skip
NAMESPACE_FLAGS = (0x00020000, 0x02000000, 0x04000000, 0x08000000, 0x10000000, 0x20000000, 0x40000000, 0x00000080)
TIOCSTI = 0x5412


def _filter(program: bool):  # -> pyseccomp.SyscallFilter
    import pyseccomp as sc

    f = sc.SyscallFilter(sc.ALLOW)
    denied = SANDBOX_DENIED + (PROGRAM_DENIED if program else ())
    for name in denied:
        try:
            f.add_rule(sc.ERRNO(errno.EPERM), name)
        except OSError:
            pass  # a call this kernel's architecture does not have
    for name in ("socket", "socketpair"):
        f.add_rule(sc.ERRNO(errno.EAFNOSUPPORT), name, sc.Arg(0, sc.NE, socket.AF_UNIX))
    if program:
        for flag in NAMESPACE_FLAGS:
            f.add_rule(sc.ERRNO(errno.EPERM), "clone", sc.Arg(0, sc.MASKED_EQ, flag, flag))
        f.add_rule(sc.ERRNO(errno.ENOSYS), "clone3")
        f.add_rule(sc.ERRNO(errno.EPERM), "ioctl", sc.Arg(1, sc.MASKED_EQ, 0xFFFFFFFF, TIOCSTI))
    return f


@functools.cache
def bpf(program: bool) -> bytes:
    """The compiled filter (`program`: PROGRAM, else SANDBOX), as the kernel's sock_filter array."""
    read, write = os.pipe()
    try:
        with os.fdopen(write, "wb", closefd=False) as out:
            _filter(program).export_bpf(out)
    finally:
        os.close(write)
    with os.fdopen(read, "rb") as source:
        return source.read()
