"""The sandbox's inside: set up one run's namespaces and limits, then run the model's program.

Never imported by the framework: it runs inside bubblewrap (`bwrap.py`), as a script of its own
(`python -I -S child.py FD`, the run's request as JSON in the file FD) or loaded by the zygote
(`zygote.py`), which forks each run's PID 1 straight into its namespaces (`fork_into_namespaces`, then
`init`: step 2, with no leader) where the machine's clone(2) is known, else forks a leader (`lead`). It
uses the standard library only. bubblewrap has already given this process a read-only view of the host
(`view.py`), no network, no /proc of the host and the SANDBOX seccomp filter. A run then goes:

1. The leader (this process, the run's process group leader) enters fresh mount, PID, network and IPC
   namespaces, and a fresh user namespace too unless it is root: as root every run gets its own
   unprivileged uid instead (the parent picks it), as another user the run's own user namespace is
   what gives it a process count of its own (RLIMIT_NPROC counts per user namespace and uid), and
   the capabilities to build its mounts. It forks the namespace's PID 1 and exits with its status.
2. PID 1 takes the run's environment, mounts a /proc of the run's PID namespace (only the run's
   processes), size-capped tmpfs on /tmp, /dev/shm and the work dir (`workdir`, holding the request's
   files), forks the program and reaps every orphan until the program ends; when it exits the kernel
   kills what is left.
3. The program's process sets the rlimits (CPU seconds, address space, file size, process count,
   open files, no core dumps; hard limits too), drops every capability (as root: to the run's uid),
   sets no_new_privs, loads the PROGRAM seccomp filter (no exec, no mounts, no namespaces: see
   `seccomp.py`) and runs the program with `runpy` as `__main__`, from the work dir.

Without isolation (`isolated` false: `sandbox.unsafe_no_isolation`), step 3 alone runs, in a temp dir
of the host, with the rlimits only.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import os
import resource
import signal
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUSER = 0x00020000, 0x08000000, 0x10000000
CLONE_NEWPID, CLONE_NEWNET = 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REC, MS_PRIVATE = 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_NO_NEW_PRIVS, PR_SET_SECCOMP, PR_CAP_AMBIENT = 1, 38, 22, 47
PR_CAP_AMBIENT_CLEAR_ALL, SECCOMP_MODE_FILTER = 4, 2
CAPABILITY_VERSION_3 = 0x20080522

SYS_CLONE = {"x86_64": 56, "aarch64": 220}

_libc = ctypes.CDLL(None, use_errno=True)
_libc_holding_gil = ctypes.PyDLL(None, use_errno=True)  # a fork must not let another thread run mid-call


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def libc_call(name: str, *args: object) -> None:
    if getattr(_libc, name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"sandbox: {name} failed: {os.strerror(errno)}")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    args = [
        source.encode() if source else None,
        target.encode(),
        fstype.encode() if fstype else None,
        ctypes.c_ulong(flags),
        data.encode() if data else None,
    ]
    if _libc.mount(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"sandbox: mount {source} on {target} failed: {os.strerror(errno)}")


def exit_as_interpreter(run: Callable[[], None]) -> NoReturn:
    """Run `run()` and end this process as an interpreter ends after its main script: non-daemon
    threads joined, atexit functions run, stdout and stderr flushed, the status of SystemExit or 1
    after a traceback."""
    try:
        run()
        code = 0
    except SystemExit as stop:
        code = _exit_code(stop.code)
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        if "threading" in sys.modules:
            sys.modules["threading"]._shutdown()  # type: ignore[attr-defined]
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    os._exit(code)


def _exit_code(code: object) -> int:
    """The exit status `raise SystemExit(code)` gives (a message is printed, and gives 1)."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def without_site(site_dirs: list[str]) -> None:
    """What `site` would have given this interpreter (started with `-S`), less the .pth files: the
    site-packages directories on the path, and the builtins `exit`, `quit`, `help`, `copyright`,
    `credits` and `license` that programs may call."""
    import site

    sys.path.extend(d for d in site_dirs if d not in sys.path)
    site.setquit()
    site.setcopyright()
    site.sethelper()


def lead(request: dict) -> NoReturn:
    """The run's leader: fds 0-2 are the run's and its process group is set. Enters the run's namespaces,
    forks its PID 1 and exits with the program's status (128 + signal if killed); without isolation, runs
    the program itself with the run's environment."""
    if not request["isolated"]:
        _take_environment(request)
        exit_as_interpreter(lambda: _program(request))
    uid, gid = os.geteuid(), os.getegid()
    libc_call("unshare", namespace_flags(request))
    pid = os.fork()
    if pid == 0:
        # Should the leader die before this, the parent's kill of the run's process group ends it.
        libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        exit_as_interpreter(lambda: init(request, uid, gid))
    _, status = os.waitpid(pid, 0)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def namespace_flags(request: dict) -> int:
    """The namespaces a run gets: mount, PID, network and IPC, and a user namespace unless it has a uid of its own."""
    return CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | CLONE_NEWIPC | (CLONE_NEWUSER if request["uid"] is None else 0)


def can_fork_into_namespaces() -> bool:
    return os.uname().machine in SYS_CLONE


def fork_into_namespaces(flags: int) -> int:
    """`os.fork()` whose child starts in new namespaces (clone(2) with `flags`): with CLONE_NEWPID the
    child is PID 1 of its own PID namespace, with no leader in between. Python's fork hooks run as
    `os.fork()` runs them; the call holds the GIL, so the caller must have no other thread."""
    python = ctypes.pythonapi
    python.PyOS_BeforeFork()
    pid = _libc_holding_gil.syscall(SYS_CLONE[os.uname().machine], ctypes.c_ulong(flags | signal.SIGCHLD), 0, 0, 0, 0)
    errno = ctypes.get_errno()
    if pid == 0:
        python.PyOS_AfterFork_Child()
        return 0
    python.PyOS_AfterFork_Parent()
    if pid < 0:
        raise OSError(errno, f"sandbox: clone failed: {os.strerror(errno)}")
    return pid


def init(request: dict, uid: int, gid: int) -> None:
    """PID 1 of the run's namespaces (`uid`, `gid`: the caller's outside them): the run's environment,
    mounts, then fork the program and reap until it ends."""
    _take_environment(request)
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    _mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    if request["uid"] is None:  # the run's own user namespace: map its one user to the caller's
        with open("/proc/self/setgroups", "w") as f:
            f.write("deny")
        with open("/proc/self/uid_map", "w") as f:
            f.write(f"{uid} {uid} 1")
        with open("/proc/self/gid_map", "w") as f:
            f.write(f"{gid} {gid} 1")
    else:
        uid = gid = request["uid"]
    for path in ("/tmp", "/dev/shm"):
        _mount("tmpfs", path, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=1777,size={16 << 20}")
    workdir, size = request["workdir"], request["limits"]["disk_bytes"]
    _mount("tmpfs", workdir, "tmpfs", MS_NOSUID | MS_NODEV, f"mode=0700,uid={uid},gid={gid},size={size}")
    for name, text in request["files"].items():
        path = os.path.join(workdir, name)
        with open(path, "w") as f:
            f.write(text)
        os.chown(path, uid, gid)
    pid = os.fork()
    if pid == 0:
        exit_as_interpreter(lambda: _program(request))
    sys.stdout.flush()
    os._exit(_reap(pid))


def _take_environment(request: dict) -> None:
    os.environ.clear()
    os.environ.update(request["env"])


def _reap(pid: int) -> int:
    """PID 1's loop: reap every orphan; return the program's exit code (128 + signal)."""
    while True:
        try:
            reaped, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return 1
        if reaped == pid:
            return os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)


def _program(request: dict) -> None:
    """The program's process: limits, no privileges, the seccomp filter, then the program."""
    workdir = request["workdir"]
    _set_limits(request["limits"], own_count=request["isolated"])
    if request["isolated"]:
        _drop_privileges(request["uid"])
        _load_seccomp(bytes.fromhex(request["seccomp"]))
    os.chdir(workdir)
    sys.path.insert(0, workdir)
    sys.argv = [request["main"]]
    import runpy

    runpy.run_path(os.path.join(workdir, request["main"]), run_name="__main__")


def _set_limits(limits: dict, own_count: bool) -> None:
    """The run's rlimits, hard ones too. The process count is the run's own in isolation (a user
    namespace or a uid of its own); without, the user's current count plus the limit."""
    cpu = limits["cpu_s"]
    processes = limits["processes"] if own_count else _process_count() + limits["processes"]
    for name, soft, hard in (
        ("RLIMIT_CPU", cpu, cpu + 1),
        ("RLIMIT_AS", limits["memory_bytes"], limits["memory_bytes"]),
        ("RLIMIT_FSIZE", limits["file_size_bytes"], limits["file_size_bytes"]),
        ("RLIMIT_NPROC", processes, processes),
        ("RLIMIT_NOFILE", limits["open_files"], limits["open_files"]),
        ("RLIMIT_CORE", 0, 0),
    ):
        resource.setrlimit(getattr(resource, name), (soft, hard))


def _process_count() -> int:
    uid, count = os.getuid(), 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return count


def _drop_privileges(uid: int | None) -> None:
    """As root: become the run's uid (which clears every capability). Otherwise: clear the capabilities
    the run's user namespace gave. Then no_new_privs: no exec could regain any."""
    if uid is not None:
        os.setgroups([])
        os.setresgid(uid, uid, uid)
        os.setresuid(uid, uid, uid)
    else:
        libc_call("prctl", PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
        data = (_CapData * 2)()
        libc_call("capset", ctypes.byref(_CapHeader(CAPABILITY_VERSION_3, 0)), data)
    libc_call("prctl", PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def _load_seccomp(bpf: bytes) -> None:
    buffer = ctypes.create_string_buffer(bpf, len(bpf))
    program = _SockFprog(len(bpf) // 8, ctypes.cast(buffer, ctypes.c_void_p))
    libc_call("prctl", PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(program), 0, 0)


def main() -> None:
    """A fresh interpreter's run: the request in the file whose fd is argv[1] (a memfd); this process
    is already the run's leader."""
    with os.fdopen(int(sys.argv[1]), "rb") as source:
        request = json.loads(source.read())
    without_site(request["site_dirs"])
    lead(request)


if __name__ == "__main__":
    main()
