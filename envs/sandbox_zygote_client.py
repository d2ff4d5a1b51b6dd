"""The parent's side of the sandbox's zygote (`envs/sandbox_zygote.py`): one per process, shared by
every event loop and thread, started on the first isolated run.

`zygote()` gives the live zygote, starting one when there is none, or None once zygotes have been lost
MAX_LOSSES times in this process (the sandbox then starts fresh interpreters, as before). `spawn`
starts a run and gives a `ZygoteRun` shaped like asyncio's `Process` (pid, stdin, stdout, stderr,
wait()). A zygote that dies, stops answering or refuses a run raises `ZygoteLost` in the runs it had
(their processes die with it), and the sandbox runs them again on fresh interpreters: no run is lost.
A reader thread takes the zygote's answers and hands each to its run's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

log = logging.getLogger("mas_async.sandbox")

ZYGOTE = Path(__file__).with_name("sandbox_zygote.py")
START_TIMEOUT_S = 10.0  # from a run's request to the zygote's answer that its leader is forked
MAX_LOSSES = 3
FDS_PER_RUN = 3


class ZygoteLost(RuntimeError):
    """The zygote died, stopped answering or could not start a run; the run is to be started afresh."""


class ZygoteRun:
    """One run started by the zygote, with the parent's ends of its pipes."""

    def __init__(self, pid: int, exited: asyncio.Future[int]) -> None:
        self.pid = pid
        self._exited = exited
        self.stdin: asyncio.StreamWriter | None = None
        self.stdout: asyncio.StreamReader = asyncio.StreamReader()
        self.stderr: asyncio.StreamReader = asyncio.StreamReader()
        self._transports: list[asyncio.BaseTransport] = []

    async def wait(self) -> int:
        """The leader's return code (negative: the signal that killed it); ZygoteLost if the zygote died."""
        return await asyncio.shield(self._exited)

    def close(self) -> None:
        for transport in self._transports:
            transport.close()


class Zygote:
    """A running zygote process and the runs it has in flight."""

    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self.process = subprocess.Popen(
                [sys.executable, "-I", "-S", str(ZYGOTE), str(theirs.fileno())],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,  # not a terminal, as a run's stdout is not: buffered the same way
                env=env,
                cwd="/",
                start_new_session=True,  # a Ctrl-C in the parent's terminal is the parent's to handle
            )
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self._sock = ours
        self._lock = threading.Lock()
        self._runs: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[int], asyncio.Future[int]]] = {}
        self._ids = itertools.count()
        self.lost: str | None = None
        threading.Thread(target=self._read, name="sandbox-zygote", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.process.pid

    async def spawn(self, config: dict[str, Any], env: dict[str, str], stdin: bool) -> ZygoteRun:
        """Start a run: the zygote forks its leader with fresh pipes as its stdin, stdout and stderr."""
        loop = asyncio.get_running_loop()
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        in_read, in_write = os.pipe() if stdin else (os.open(os.devnull, os.O_RDONLY), -1)
        theirs = [in_read, out_write, err_write]
        ours = [fd for fd in (in_write, out_read, err_read) if fd >= 0]
        try:
            pid, exited = await self._start(loop, config, env, theirs)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)  # the zygote has its own copies
        run = ZygoteRun(pid, exited)
        pipes = [os.fdopen(out_read, "rb", 0), os.fdopen(err_read, "rb", 0)]
        pipes += [os.fdopen(in_write, "wb", 0)] if stdin else []
        try:
            for pipe, reader in zip(pipes[:2], (run.stdout, run.stderr), strict=True):
                transport, _ = await loop.connect_read_pipe(lambda r=reader: asyncio.StreamReaderProtocol(r), pipe)
                run._transports.append(transport)
            if stdin:
                transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, pipes[2])
                run._transports.append(transport)
                run.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        except BaseException:
            run.close()
            for pipe in pipes:
                pipe.close()
            kill_group(pid)
            raise
        return run

    async def _start(
        self, loop: asyncio.AbstractEventLoop, config: dict, env: dict[str, str], fds: list[int]
    ) -> tuple[int, asyncio.Future[int]]:
        started: asyncio.Future[int] = loop.create_future()
        exited: asyncio.Future[int] = loop.create_future()
        with self._lock:
            if self.lost:
                raise ZygoteLost(self.lost)
            run_id = next(self._ids)
            self._runs[run_id] = (loop, started, exited)
            try:
                message = json.dumps({"id": run_id, "config": config, "env": env})
                socket.send_fds(self._sock, [message.encode()], fds, socket.MSG_DONTWAIT)
            except OSError as error:
                del self._runs[run_id]
                self._lose(f"the zygote took no more runs ({error})")
                raise ZygoteLost(self.lost) from error
        try:
            return await asyncio.wait_for(asyncio.shield(started), START_TIMEOUT_S), exited
        except asyncio.TimeoutError:
            self._lose(f"the zygote did not start a run within {START_TIMEOUT_S}s")
            raise ZygoteLost(self.lost) from None
        except asyncio.CancelledError:  # nobody will supervise this run: end it as soon as it exists
            started.add_done_callback(lambda f: f.cancelled() or f.exception() or kill_group(f.result()))
            raise

    def _read(self) -> None:
        """The reader thread: hand every answer to its run's loop, until the zygote's socket ends."""
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except OSError as error:
                data, reason = b"", f"its socket failed ({error})"
            else:
                reason = f"it exited (status {self.process.poll()})"
            if not data:
                self._lose(f"the zygote was lost: {reason}")
                return
            answer = json.loads(data)
            with self._lock:
                entry = self._runs.get(answer["id"])
                if entry is None:
                    continue
                if "returncode" in answer or "error" in answer:
                    del self._runs[answer["id"]]
            loop, started, exited = entry
            if "pid" in answer:
                _deliver(loop, started, answer["pid"])
            elif "returncode" in answer:
                _deliver(loop, exited, answer["returncode"])
            else:
                _deliver(loop, started, ZygoteLost(f"the zygote could not start a run: {answer['error']}"))

    def _lose(self, reason: str) -> None:
        """Mark the zygote lost, fail its runs, and end it (its runs' processes die with it)."""
        with self._lock:
            if self.lost is None:
                self.lost = reason
                log.warning("sandbox: %s; its runs start again on fresh interpreters", reason)
            runs, self._runs = self._runs, {}
        for loop, started, exited in runs.values():
            for future in (started, exited):
                _deliver(loop, future, ZygoteLost(reason))
        with contextlib.suppress(OSError):
            self.process.kill()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        """End the zygote (runs in flight fail with ZygoteLost) and reap it."""
        self._lose("the zygote was closed")
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=5.0)


def kill_group(pgid: int) -> None:
    """SIGKILL to a run's process group (the leader's pid), gone or not."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def _deliver(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value: object) -> None:
    def settle() -> None:
        if future.done():
            return
        if isinstance(value, BaseException):
            future.set_exception(value)
            future.exception()  # a run that is no longer awaited must not log "never retrieved"
        else:
            future.set_result(value)

    with contextlib.suppress(RuntimeError):  # that loop is closed: nobody awaits this run any more
        loop.call_soon_threadsafe(settle)


_shared: Zygote | None = None
_shared_pid = 0  # the process that started _shared (a forked copy of it must start its own)
_losses = 0
_shared_lock = threading.Lock()


def zygote(env: dict[str, str]) -> Zygote | None:
    """This process's zygote (started with `env` when there is none), or None after MAX_LOSSES."""
    global _shared, _shared_pid, _losses
    with _shared_lock:
        if _shared is not None and _shared_pid != os.getpid():
            _shared = None  # inherited by fork: that zygote and its reader thread are the parent's
        if _shared is not None and (_shared.lost or _shared.process.poll() is not None):
            _shared.close()
            _shared = None
            _losses += 1
            if _losses == MAX_LOSSES:
                log.warning("sandbox: %d zygotes lost; runs start on fresh interpreters from now on", MAX_LOSSES)
        if _shared is None and _losses < MAX_LOSSES:
            try:
                _shared, _shared_pid = Zygote(env), os.getpid()
            except OSError as error:
                _losses += 1
                log.warning("sandbox: the zygote did not start (%s)", error)
        return _shared
