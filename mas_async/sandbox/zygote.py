"""The sandbox's zygote: a warm interpreter inside bubblewrap that starts each run by fork.

A fresh interpreter per run (`bwrap ... python -I -S child.py`) spends about 25 ms of CPU before the
program starts: bubblewrap, the interpreter, its imports. This process pays that once. It is started by
`zygote_client.py` as `bwrap ... python -I -S zygote.py FD` (bwrap.py: the same sandbox as a fresh
run's); FD is its end of a SOCK_SEQPACKET unix socket. It uses the standard library and `child.py`
(loaded by path: the checkout is never on `sys.path`) only.

Per run the parent sends one message, JSON {"id", "run" (child.py's request)}, with the run's
stdin, stdout and stderr as SCM_RIGHTS fds. The zygote forks the run's first process, answers {"id",
"pid"} (a pid of the sandbox's own PID namespace: the parent asks {"kill": id} to end the run's process
group), and when that process is reaped {"id", "returncode"} (negative: killed by that signal, as
asyncio's `Process.returncode`); a run it could not fork gets {"id", "error"}. The run's first process:

- gets its own process group (the parent kills it at the end), made by the zygote before it answers,
  so a kill cannot come before the group exists; it dies with the zygote (PDEATHSIG);
- takes the run's fds as 0, 1 and 2 with every other fd closed (the zygote's socket above all),
  default signal handling;
- is, for an isolated run, the run's PID 1, forked straight into the run's namespaces
  (`child.fork_into_namespaces`), and goes on as a fresh interpreter's PID 1 does (`child.init`: its
  mounts, the program): no leader stands between the zygote and PID 1 (~1 ms of CPU less per run).
  Where the machine's clone(2) is not known, and for a run without isolation, it is a leader that does
  what a fresh interpreter's run does (`child.lead`).

The program's process ends as an interpreter would (`child.exit_as_interpreter`). What differs from a
fresh interpreter: `str` hashes use the zygote's seed (`random` is reseeded at fork). The zygote exits
when the parent closes its socket (and with the parent: bubblewrap's --die-with-parent).
"""

from __future__ import annotations

import importlib.util
import json
import os
import pkgutil  # noqa: F401  runpy.run_path imports it (and weakref) at each call: ~1.3 ms a run
import random  # noqa: F401  imported once here: the function-test harness of most runs imports it (~1.5 ms each)
import resource
import runpy  # noqa: F401  imported here once, for every run's program
import select
import selectors
import signal
import socket
import sys

FDS_PER_RUN = 3
MAX_MESSAGE = 8 << 20  # a run's request carries its files (program, tests)

_spec = importlib.util.spec_from_file_location("sandbox_child", os.path.join(os.path.dirname(__file__), "child.py"))
assert _spec is not None and _spec.loader is not None
child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(child)
_EXITED = os.pidfd_open(os.getpid())  # readable once the zygote has exited: a run's check that it has a parent


def _detach(fds: list[int]) -> None:
    """The run's first process, a fresh child of the zygote, leaves the zygote's group, signals and fds:
    see the module's docstring."""
    os.setpgid(0, 0)  # as the zygote does; the zygote's session has no terminal
    child.libc_call("prctl", child.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if select.select([_EXITED], [], [], 0)[0]:
        os._exit(1)  # the zygote died before PDEATHSIG was set
    signal.set_wakeup_fd(-1)
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    for number, fd in enumerate(fds):
        os.dup2(fd, number)
    os.closerange(FDS_PER_RUN, resource.getrlimit(resource.RLIMIT_NOFILE)[0])  # close_range(2) where there is one


def _start(run: dict, fds: list[int]) -> int:
    if run["isolated"] and child.can_fork_into_namespaces():  # the run's PID 1, with no leader
        uid, gid = os.geteuid(), os.getegid()
        pid = child.fork_into_namespaces(child.namespace_flags(run))
        if pid == 0:
            child.exit_as_interpreter(lambda: (_detach(fds), child.init(run, uid, gid)))
    else:
        pid = os.fork()
        if pid == 0:
            child.exit_as_interpreter(lambda: (_detach(fds), child.lead(run)))
    os.setpgid(pid, pid)  # before the answer: the parent may kill the group as soon as it has it
    return pid


def _send(sock: socket.socket, message: dict) -> None:
    sock.send(json.dumps(message).encode())


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
        if "kill" in request:  # the parent is done with a run: end its process group (PID 1 with it)
            for pid in [pid for pid, run_id in runs.items() if run_id == request["kill"]]:
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            return
        if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC) or len(fds) != FDS_PER_RUN:
            raise ValueError(f"a run needs one message under {MAX_MESSAGE} bytes and {FDS_PER_RUN} fds")
        pid = _start(request["run"], fds)
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
    child.without_site(json.loads(sys.argv[2]))
    serve(sock)


if __name__ == "__main__":
    main()
