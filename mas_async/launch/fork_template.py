"""A preloaded template of the fork server, shared by many short runs on one machine
(`python -m mas_async.launch.fork_template SOCKET`).

A node's fork server spends ~10 CPU-s importing torch and transformers at the start of every run. A series
of short runs (the test suite, a sweep) can keep one template that imported them once: a launcher whose
environment names the template's socket (`MAS_ASYNC_FORK_TEMPLATE`) gets the fork server of each node
without a command prefix as a fork of the template. That fork behaves as a new server would: requests and
replies go over the launcher's connection, its log is the run's, it ends when the connection closes (the
launcher ended, even by SIGKILL), and its children then stop; it takes the launcher's `sys.path`, so
modules it has not imported come from where the launcher's own server would find them. A template serves
only launchers with its interpreter that would import the preloaded packages from the same files; any
other launcher, or one that cannot reach it, starts a server of its own as usual.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

import setproctitle

from mas_async.launch import fork_server
from mas_async.launch.fork_server import PRELOAD, ForkServer, preload, reap, serve_requests

TEMPLATE_ENV = "MAS_ASYNC_FORK_TEMPLATE"
HELLO_TIMEOUT_S = 5.0
"""How long either side waits for the other's first line."""
MAX_LINE_BYTES = 1 << 16


def identity() -> dict[str, Any]:
    """What must match between a template and a launcher for the template's imports to be the ones the
    launcher's own server would make: the interpreter, and where each preloaded package comes from."""
    origins = {}
    for name in sorted({module.split(".")[0] for module in PRELOAD}):
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            spec = None
        origins[name] = spec.origin if spec is not None else None
    return {"executable": sys.executable, "origins": origins}


# -- the template ------------------------------------------------------------------------------------


def serve_template(path: str) -> int:
    """Preload, listen on the Unix socket `path`, fork a fork server per launcher that connects."""
    preload()
    own = identity()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    print("ready", flush=True)
    while True:
        reap(lambda ended: None)  # the forks' statuses reach no one: their launchers watch their children
        if not select.select([listener], [], [], 1.0)[0]:
            continue
        conn, _ = listener.accept()
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            hello = json.loads(_read_line(conn))
            if hello.get("identity") != own:
                conn.sendall(json.dumps({"error": f"this template serves {own}"}).encode() + b"\n")
                continue
            if os.fork() == 0:
                listener.close()
                os._exit(_serve_run(conn, hello["log"], hello["sys_path"]))
        except (OSError, ValueError, KeyError) as e:
            print(f"fork template: a launcher's hello failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            conn.close()


def _serve_run(conn: socket.socket, log: str, sys_path: list[str]) -> int:
    try:
        setproctitle.setproctitle(f"{sys.executable} -m {fork_server.__name__} (forked from {__name__})")
        sys.path[:] = sys_path  # modules not imported yet come from where the launcher's server would find them
        conn.settimeout(None)
        log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(log_fd, 1)
        os.dup2(log_fd, 2)
        os.close(log_fd)
        fd = conn.detach()
        os.write(fd, json.dumps({"ready": os.getpid()}).encode() + b"\n")
        return serve_requests(fd, fd)
    except BaseException:  # noqa: BLE001 - a fork of the template never returns into its accept loop
        traceback.print_exc()
        return 1


def _read_line(conn: socket.socket) -> bytes:
    line = b""
    while not line.endswith(b"\n"):
        chunk = conn.recv(4096)
        if not chunk:
            raise OSError("the connection closed before a whole line")
        line += chunk
        if len(line) > MAX_LINE_BYTES:
            raise ValueError(f"a line longer than {MAX_LINE_BYTES} bytes")
    return line


# -- the launcher's side ----------------------------------------------------------------------------


class _Requests:
    """The writing half of the connection: closing it ends the server (it reads EOF)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn

    def write(self, data: bytes) -> None:
        self.conn.sendall(data)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        try:
            self.conn.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.conn.close()  # the socket itself closes with the replies' file


def connect(node: str, log_path: Path, timeout_s: float) -> ForkServer | None:
    """A fork server for `node` forked from the template that the environment names; None when there is
    none, it cannot be reached, or it serves another interpreter, folder or PYTHONPATH."""
    path = os.environ.get(TEMPLATE_ENV)
    if not path:
        return None
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(HELLO_TIMEOUT_S)
        conn.connect(path)
        hello = {"identity": identity(), "log": str(log_path), "sys_path": sys.path}
        conn.sendall(json.dumps(hello).encode() + b"\n")
        answer: dict[str, Any] = json.loads(_read_line(conn))
    except (OSError, ValueError):
        conn.close()
        return None
    if "ready" not in answer:
        conn.close()
        return None
    conn.settimeout(None)
    return ForkServer(node, log_path, timeout_s, answer["ready"], _Requests(conn), conn.makefile("rb"))  # type: ignore[arg-type]


if __name__ == "__main__":
    sys.exit(serve_template(sys.argv[1]))
