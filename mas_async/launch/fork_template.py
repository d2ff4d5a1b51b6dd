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

Whoever reaches the socket can run any code as the template's user (a launcher names the roles module its
processes import), so only that user may: the socket is made in a folder of the user's that no one else
can enter (0700; the template makes it, or refuses one that others can read or write), is itself 0600, and
every connection's peer credentials (SO_PEERCRED) must carry the template's own uid, else it is closed
before anything is read. A launcher likewise takes a fork server only from a template of its own uid.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import socket
import stat
import struct
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
_UCRED = struct.Struct("3i")
"""struct ucred: pid, uid, gid (SO_PEERCRED)."""


class TemplateError(RuntimeError):
    """The template cannot serve safely where it was asked to (its socket's folder is not private)."""


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of the Unix socket `conn`, as the kernel recorded it."""
    _pid, uid, _gid = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
    return uid


def private_folder(folder: Path) -> None:
    """Make `folder` (mode 0700) or check that it is this user's and closed to everyone else."""
    folder.mkdir(mode=0o700, parents=True, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise TemplateError(
            f"the fork template's socket must be in a folder only its user can enter; {folder} is owned by uid "
            f"{info.st_uid} with mode {stat.S_IMODE(info.st_mode):o} (want uid {os.geteuid()}, mode 700): choose "
            "a path in a private folder, e.g. one made by mkdir -m 700"
        )


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
    """Preload, listen on the Unix socket `path` (in a private folder, mode 0600), fork a fork server per
    launcher of this user that connects."""
    private_folder(Path(path).parent)
    preload()
    own = identity()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    umask = os.umask(0o177)  # the socket is 0600 from the moment it exists
    try:
        listener.bind(path)
    finally:
        os.umask(umask)
    listener.listen(64)
    print("ready", flush=True)
    refused = 0
    while True:
        reap(lambda ended: None)  # the forks' statuses reach no one: their launchers watch their children
        if not select.select([listener], [], [], 1.0)[0]:
            continue
        conn, _ = listener.accept()
        try:
            if (uid := peer_uid(conn)) != os.geteuid():
                refused += 1
                print(f"fork template: refused a connection from uid {uid} ({refused} so far)", file=sys.stderr,
                      flush=True)  # fmt: skip
                continue
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
        if peer_uid(conn) != os.geteuid():  # another user's template would run this launcher's processes
            conn.close()
            return None
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


def main(argv: list[str]) -> int:
    try:
        return serve_template(argv[0])
    except TemplateError as e:
        print(f"fork template: {e}", file=sys.stderr, flush=True)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
