"""The sandbox's zygote: a warm interpreter that starts each isolated run by fork, not by a fresh one.

A fresh interpreter per run (`unshare ... python -I -S sandbox_child.py`) spends about 20 ms of CPU
before the program starts: the interpreter, its imports, `unshare`. This process pays that once. It is
a script, started by `envs/sandbox_zygote_client.py` as `python -I -S sandbox_zygote.py FD` with the
minimal environment of a run; FD is its end of a SOCK_SEQPACKET unix socket. It uses the standard
library and `sandbox_child.py` (loaded by path: the checkout is never on `sys.path`) only.

Per run the parent sends one message, JSON {"id", "config" (sandbox_child's), "env"}, with the run's
stdin, stdout and stderr as SCM_RIGHTS fds. The zygote forks the run's leader, answers {"id", "pid"},
and when the leader is reaped {"id", "returncode"} (negative: killed by that signal, as asyncio's
`Process.returncode`); a run it could not fork gets {"id", "error"}. The leader plays `unshare --fork
--kill-child`'s part:

- its own process group (the parent kills it at the end), made by the zygote before it answers, so a
  kill cannot come before the group exists; it dies with the zygote (PDEATHSIG);
- the run's fds as 0, 1 and 2 and every other fd closed (the zygote's socket above all), default
  signal handling, the run's environment and work dir;
- fresh mount (propagation private), network and PID namespaces; then it forks the namespace's PID 1,
  which does what `sandbox_child.run_isolated` does (the view is computed here once, and again only
  when a site dir changes), and exits with its status (128 + the signal when it was killed).

The program's process ends as an interpreter would (`_exit_as_interpreter`): non-daemon threads joined,
atexit functions run, stdout and stderr flushed, the exit status of SystemExit or 1 after a traceback.
What differs from a fresh interpreter: `str` hashes use the zygote's seed (`random` is reseeded at
fork). The zygote exits when the parent closes its socket.
"""

from __future__ import annotations

import atexit
import ctypes
import importlib.util
import json
import os
import runpy  # noqa: F401  imported here once, for every run's program
import selectors
import signal
import socket
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

CLONE_NEWNS, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x20000000, 0x40000000
MS_REC, MS_PRIVATE = 16384, 1 << 18
PR_SET_PDEATHSIG = 1
FDS_PER_RUN = 3
MAX_MESSAGE = 1 << 20

_spec = importlib.util.spec_from_file_location(
    "sandbox_child", os.path.join(os.path.dirname(__file__), "sandbox_child.py")
)
assert _spec is not None and _spec.loader is not None
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)
_libc = ctypes.CDLL(None, use_errno=True)
_views: dict[tuple, tuple] = {}


def _libc_call(name: str, *args: object) -> None:
    if getattr(_libc, name)(*args) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"sandbox zygote: {name} failed: {os.strerror(errno)}")


def _view(config: dict) -> child.View:
    """`sandbox_child._view(config)`, kept while the site dirs (where hidden packages could appear)
    are unchanged."""
    dirs = config["site_dirs"]
    key = (config["project"], tuple(config["hidden"]), tuple(dirs), tuple(_mtime(d) for d in dirs))
    if key not in _views:
        _views.clear()
        _views[key] = child._view(config)
    return _views[key]


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def _exit_as_interpreter(run: Callable[[], None]) -> NoReturn:
    """Run `run()` and end this process as an interpreter ends after its main script."""
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


def _lead(request: dict, fds: list[int], view: child.View, zygote: int) -> None:
    """The run's leader (a fresh child of the zygote): see the module's docstring."""
    os.setpgid(0, 0)  # as the zygote does; the zygote's session has no terminal
    _libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != zygote:
        os._exit(1)  # the zygote died before PDEATHSIG was set
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for number, fd in enumerate(fds):
        os.dup2(fd, number)
    for fd in [int(name) for name in os.listdir("/proc/self/fd")]:  # not closerange: a loop to the limit
        if fd >= FDS_PER_RUN:  # where close_range is missing; the listing's own fd is closed already
            try:
                os.close(fd)
            except OSError:
                pass
    os.environ.clear()
    os.environ.update(request["env"])
    config = request["config"]
    os.chdir(config["workdir"])
    _libc_call("unshare", CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID)
    child._mount(None, "/", None, MS_REC | MS_PRIVATE)
    pid = os.fork()
    if pid == 0:  # PID 1 of the new namespaces, then (returning) the program
        # Should the leader die before this, the parent's kill of the run's process group ends it.
        _libc_call("prctl", PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        _exit_as_interpreter(lambda: child.run_isolated(config, view))
    _, status = os.waitpid(pid, 0)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status))


def _send(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode())


def _start(request: dict, fds: list[int]) -> int:
    config = request["config"]
    child._without_site(config["site_dirs"])  # before the view, which follows sys.path
    view = _view(config)
    zygote = os.getpid()
    pid = os.fork()
    if pid == 0:
        _exit_as_interpreter(lambda: _lead(request, fds, view, zygote))
    os.setpgid(pid, pid)  # before the answer: the parent may kill the group as soon as it has it
    return pid


def serve(sock: socket.socket) -> None:
    """Start runs as the parent asks and report how they end, until the parent closes the socket."""
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_read, False)
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(sock, selectors.EVENT_READ)
    selector.register(wake_read, selectors.EVENT_READ)
    runs: dict[int, int] = {}  # leader pid -> run id
    while True:
        for key, _events in selector.select():
            if key.fileobj is sock:
                message, fds, flags, _address = socket.recv_fds(sock, MAX_MESSAGE, FDS_PER_RUN)
                if not message:
                    return
                _serve_one(sock, message, fds, flags, runs)
            else:
                while True:
                    try:
                        if not os.read(wake_read, 4096):
                            break
                    except BlockingIOError:
                        break
        _reap(sock, runs)


def _serve_one(sock: socket.socket, message: bytes, fds: list[int], flags: int, runs: dict[int, int]) -> None:
    request: dict = {}
    try:
        request = json.loads(message)
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != FDS_PER_RUN:
            raise ValueError(f"a run needs one message under {MAX_MESSAGE} bytes and {FDS_PER_RUN} fds")
        pid = _start(request, fds)
    except (OSError, ValueError, KeyError) as error:
        _send(sock, {"id": request.get("id"), "error": f"{type(error).__name__}: {error}"})
        return
    finally:
        for fd in fds:
            os.close(fd)
    runs[pid] = request["id"]
    _send(sock, {"id": request["id"], "pid": pid})


def _reap(sock: socket.socket, runs: dict[int, int]) -> None:
    while runs:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in runs:
            _send(sock, {"id": runs.pop(pid), "returncode": os.waitstatus_to_exitcode(status)})


def main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    sock.setblocking(True)
    serve(sock)


if __name__ == "__main__":
    main()
