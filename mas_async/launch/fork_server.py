"""The fork server of a node: imports torch, transformers and the actors once, then starts each process of
the run on that node as a fork of itself (`python -m mas_async.launch.fork_server`).

Without it every process of a run spends seconds of CPU importing the same libraries. The local engine
starts one server per node (through the node's command prefix, so its forks live in the node's network
namespace) and asks it for every `mas_async.launch.process` of that node (`cluster.fork_server`). The
server reads JSON lines on stdin, one per process to start (its arguments, environment, working folder
and log file), and writes JSON lines on stdout: the pid of each process it started (or why it could not)
and the exit status of each that ended. A child is in its own session before its pid is sent, so
stopping its process group cannot miss it. The server ends when its stdin closes (the launcher closed
it, or died, even by SIGKILL); its children then see their parent change and stop.
"""

from __future__ import annotations

import atexit
import importlib
import io
import json
import os
import select
import signal
import subprocess
import sys
import threading
import traceback
from pathlib import Path
from typing import Any, BinaryIO

import setproctitle

from mas_async.launch import process
from mas_async.launch.engines.base import EngineError
from mas_async.runtime.actor import PARENT_PID_ENV

PRELOAD = (
    "torch",
    "transformers.modeling_utils",
    "transformers.generation.utils",
    "transformers.tokenization_utils_fast",
    "numpy",
    "zmq.asyncio",
    "msgpack",
    "uvloop",
    "mas_async.launch.process",
    "mas_async.router.hub",
    "mas_async.rollout.env_worker",
    "mas_async.inference.server",
    "mas_async.training.trainer",
)
"""What every process of a run imports anyway; a module that fails to import is left to the child."""

READY_TIMEOUT_S = 10.0
"""How long the server waits for a new child to enter its own session."""


# -- the server ------------------------------------------------------------------------------------


def serve(requests_fd: int = 0) -> int:
    """Preload, then start a child per request until `requests_fd` closes; replies go to stdout."""
    # The replies keep the pipe of stdout; what anything else prints goes to the log (stderr).
    replies_fd = os.dup(1)
    os.dup2(2, 1)
    preload()
    return serve_requests(requests_fd, replies_fd)


def preload() -> None:
    process.quiet_progress_bars()
    for name in PRELOAD:
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - the child that needs it fails with the real error
            print(f"fork server: preloading {name} failed: {e}", file=sys.stderr, flush=True)


def serve_requests(requests_fd: int, replies_fd: int) -> int:
    """Start a child per JSON line read from `requests_fd` until it closes; pids and exit statuses go to
    `replies_fd` (the two may be one socket)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the launcher stops the children; the server ends on EOF
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    own_fds = tuple(sorted({wake_r, wake_w, replies_fd, requests_fd} - {0}))

    def reply(message: dict[str, Any]) -> None:
        os.write(replies_fd, json.dumps(message).encode() + b"\n")

    forked: set[int] = set()
    """Every child started here (its process group may outlive it: signals still reach the group)."""
    buffer = b""
    while True:
        ready, _, _ = select.select([requests_fd, wake_r], [], [], 1.0)
        if wake_r in ready:
            os.read(wake_r, 4096)
        reap(reply)
        if requests_fd not in ready:
            continue
        chunk = os.read(requests_fd, 1 << 16)
        if not chunk:
            return 0
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            request = json.loads(line)
            if "signal" in request:
                _signal(request["pid"], request["signal"], forked)
                continue
            try:
                pid = _fork(request, own_fds)
                forked.add(pid)
                reply({"id": request["id"], "pid": pid})
            except OSError as e:
                reply({"id": request["id"], "error": f"{type(e).__name__}: {e}"})


def _signal(pid: int, sig: int, forked: set[int]) -> None:
    """Signal the process group of child `pid`, if this server started it (a request about any other pid is
    ignored, and said in the log)."""
    if pid not in forked:
        print(f"fork server: refused to signal pid {pid}, which it did not start", file=sys.stderr, flush=True)
        return
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def reap(reply: Any) -> None:
    """Collect every ended child without blocking; `reply` gets each one's exit status."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        reply({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _fork(request: dict[str, Any], own_fds: tuple[int, ...]) -> int:
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(ready_r)
        _child(request, ready_w, own_fds)  # never returns
    os.close(ready_w)
    try:
        if not select.select([ready_r], [], [], READY_TIMEOUT_S)[0] or os.read(ready_r, 1) != b"1":
            raise OSError(f"child {pid} did not enter its own session within {READY_TIMEOUT_S:.0f} s")
    finally:
        os.close(ready_r)
    return pid


def _child(request: dict[str, Any], ready_w: int, own_fds: tuple[int, ...]) -> None:
    code = 1
    try:
        os.setsid()
        os.write(ready_w, b"1")
        os.close(ready_w)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        for fd in own_fds:
            os.close(fd)
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        # Fresh streams on the new descriptors: none of the server's buffered bytes reach the log.
        sys.stdin = open(0, closefd=False)  # noqa: SIM115
        sys.stdout = io.TextIOWrapper(open(1, "wb", buffering=0, closefd=False), write_through=True)  # noqa: SIM115
        sys.stderr = io.TextIOWrapper(open(2, "wb", buffering=0, closefd=False), write_through=True)  # noqa: SIM115
        os.chdir(request["cwd"])
        # `ps` shows the command line the process would have had as a new interpreter (set before the
        # environment changes: setproctitle finds the space it rewrites next to the environment's).
        sys.argv = [process.__file__, *request["argv"]]
        setproctitle.setproctitle(" ".join([sys.executable, "-m", process.__name__, *request["argv"]]))
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ[PARENT_PID_ENV] = str(os.getppid())
        code = process.main(request["argv"])
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the process boundary: logged, status 1
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


# -- the launcher's side ----------------------------------------------------------------------------


class ForkServer:
    """The launcher's handle on the fork server of one node: starts children, tells their exit status.

    `spawn` starts a new server; `fork_template.connect` gets one forked from a preloaded template. Either
    way requests go to `requests` and replies come from `replies`, and the server ends when `requests`
    closes."""

    def __init__(
        self,
        node: str,
        log_path: Path,
        timeout_s: float,
        pid: int,
        requests: BinaryIO,
        replies: BinaryIO,
        local: bool = True,
    ) -> None:
        self.node = node
        self.local = local
        """The server runs on this machine, in its pid namespace (no command prefix): its children are
        signalled here directly, which works even once the server is gone."""
        self.log_path = log_path
        self.timeout_s = timeout_s
        self.pid = pid
        self.proc: subprocess.Popen | None = None
        """The server's process when this launcher started it (`spawn`), so its exit status is known."""
        self._requests = requests
        self._replies_in = replies
        self._lock = threading.Condition()
        self._writing = threading.Lock()
        """One request line at a time on the connection (starts and signals may come from two threads)."""
        self._replies: dict[int, dict[str, Any]] = {}
        self._codes: dict[int, int] = {}
        self._gone = False
        self._next_id = 0
        self._reader = threading.Thread(target=self._read, name=f"fork-server-{node}", daemon=True)
        self._reader.start()

    @classmethod
    def spawn(cls, node: str, prefix: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> ForkServer:
        """A new server process (through the node's command prefix); it preloads before it answers."""
        with log_path.open("ab") as log_file:
            proc = subprocess.Popen(
                [*prefix, sys.executable, "-m", __name__],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log_file,
                env={**os.environ, **env},
            )
        assert proc.stdin is not None and proc.stdout is not None
        server = cls(node, log_path, timeout_s, proc.pid, proc.stdin, proc.stdout, local=not prefix)
        server.proc = proc
        return server

    def _read(self) -> None:
        for line in self._replies_in:
            message = json.loads(line)  # only the server writes there (anything printed goes to its log)
            with self._lock:
                if "exited" in message:
                    self._codes[message["exited"]] = message["code"]
                else:
                    self._replies[message["id"]] = message
                self._lock.notify_all()
        with self._lock:
            self._gone = True
            self._lock.notify_all()

    def start(self, name: str, argv: list[str], env: dict[str, str], log_path: Path) -> int:
        """Fork a `mas_async.launch.process` with `argv` and `env`, output into `log_path`; its pid."""
        with self._lock:
            request_id = self._next_id
            self._next_id += 1
        request = {"id": request_id, "argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log_path)}
        self._send(request)  # a server that is gone (or closed) is said below
        with self._lock:
            self._lock.wait_for(lambda: request_id in self._replies or self._gone, self.timeout_s)
            reply = self._replies.pop(request_id, None)
        if reply is None:
            why = "exited" if self._gone else f"did not answer within {self.timeout_s:.0f} s"
            raise EngineError(f"the fork server of node {self.node} {why} when starting {name} (log: {self.log_path})")
        if "error" in reply:
            raise EngineError(f"the fork server of node {self.node} could not start {name}: {reply['error']}")
        return reply["pid"]

    def signal(self, pid: int, sig: int) -> None:
        """Send `sig` to the process group of child `pid`: here when the server is local, else through the
        server, on its node (a server that is gone has nothing left to signal: its children stop when their
        parent goes)."""
        if self.local:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            return
        self._send({"signal": int(sig), "pid": pid})

    def _send(self, request: dict[str, Any]) -> None:
        """Write one request line; nothing happens if the server is gone (or the connection closed)."""
        with self._writing:
            try:
                self._requests.write(json.dumps(request).encode() + b"\n")
                self._requests.flush()
            except (OSError, ValueError):
                pass

    def returncode(self, pid: int) -> int | None:
        """The exit status of child `pid`, None while it runs. If the server died first (its children stop
        when their parent goes), a child that has ended reports 1: its real status went with the server."""
        with self._lock:
            if pid in self._codes:
                return self._codes[pid]
            if not self._gone:
                return None
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return 1
        return None

    def wait(self, pid: int, timeout: float) -> int | None:
        with self._lock:
            self._lock.wait_for(lambda: pid in self._codes or self._gone, timeout)
        return self.returncode(pid)

    def close(self, timeout_s: float = 10.0) -> None:
        """End the server (its children are stopped already): it exits when its requests end; killed if it
        has not within `timeout_s`."""
        try:
            self._requests.close()
        except OSError:
            pass
        self._reader.join(timeout=timeout_s)  # the replies end when the server exits
        if self._reader.is_alive():
            try:
                os.kill(self.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self._reader.join(timeout=timeout_s)
        if self.proc is not None:
            self.proc.wait(timeout=timeout_s)
        self._replies_in.close()


if __name__ == "__main__":
    sys.exit(serve())
