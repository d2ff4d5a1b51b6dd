"""The parent's side of the sandbox's zygote (`zygote.py`): one per process, shared by every event loop
and thread, started on the first run.

`zygote()` gives the live zygote, starting one when there is none, or None once zygotes have been lost
MAX_LOSSES times in this process (the sandbox then starts fresh interpreters). `spawn` starts a run and
gives a `ZygoteRun` shaped like asyncio's `Process` (pid, stdin, stdout, stderr, wait()). A zygote that
dies, stops answering, refuses a run or answers something that is not an answer raises `ZygoteLost` in
the runs it had (their processes die with it), and the sandbox runs them again on fresh interpreters:
no run is lost. A reader thread takes the zygote's answers and hands each to its run's event loop;
whatever ends that thread ends in the lost path, so no run waits on a zygote nobody reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import socket
import subprocess
import threading
from collections.abc import Callable
from typing import Any

from mas_async.sandbox import bwrap
from mas_async.sandbox.seccomp import bpf
from mas_async.sandbox.view import site_dirs

log = logging.getLogger("mas_async.sandbox")

ZYGOTE = "zygote.py"
START_TIMEOUT_S = 10.0  # from a run's request to the zygote's answer that its leader is forked
MAX_LOSSES = 3
FDS_PER_RUN = 3
MAX_MESSAGE = 128 << 10  # a larger request (its files) starts on a fresh interpreter


class ZygoteLost(RuntimeError):
    """The zygote died, stopped answering or could not start a run; the run is to be started afresh."""


class ZygoteRun:
    """One run started by the zygote, with the parent's ends of its pipes. `pid` is the leader's in the
    zygote's PID namespace: the zygote kills the run (`kill`), not the parent."""

    def __init__(self, pid: int, exited: asyncio.Future[int], kill: Callable[[], None]) -> None:
        self.pid = pid
        self.kill = kill
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
        seccomp_read, seccomp_write = os.pipe()
        try:
            os.write(seccomp_write, bpf(program=False))
            os.close(seccomp_write)
            command = bwrap.command(ZYGOTE, [str(theirs.fileno()), json.dumps(site_dirs())], seccomp_read)
            self.process = subprocess.Popen(
                command,
                pass_fds=[theirs.fileno(), seccomp_read],
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
            os.close(seccomp_read)
        self._sock = ours
        self._lock = threading.Lock()
        self._runs: dict[int, tuple[asyncio.AbstractEventLoop, asyncio.Future[int], asyncio.Future[int]]] = {}
        self._ids = itertools.count()
        self.lost: str | None = None
        threading.Thread(target=self._read, name="sandbox-zygote", daemon=True).start()

    @property
    def pid(self) -> int:
        return self.process.pid

    async def spawn(self, run: dict[str, Any], stdin: bool) -> ZygoteRun:
        """Start a run: the zygote forks its leader with fresh pipes as its stdin, stdout and stderr."""
        loop = asyncio.get_running_loop()
        out_read, out_write = os.pipe()
        err_read, err_write = os.pipe()
        in_read, in_write = os.pipe() if stdin else (os.open(os.devnull, os.O_RDONLY), -1)
        theirs = [in_read, out_write, err_write]
        ours = [fd for fd in (in_write, out_read, err_read) if fd >= 0]
        try:
            run_id, pid, exited = await self._start(loop, run, theirs)
        except BaseException:
            for fd in ours:
                os.close(fd)
            raise
        finally:
            for fd in theirs:
                os.close(fd)  # the zygote has its own copies
        process = ZygoteRun(pid, exited, lambda: self.kill(run_id))
        pipes = [os.fdopen(out_read, "rb", 0), os.fdopen(err_read, "rb", 0)]
        pipes += [os.fdopen(in_write, "wb", 0)] if stdin else []
        try:
            for pipe, reader in zip(pipes[:2], (process.stdout, process.stderr), strict=True):
                transport, _ = await loop.connect_read_pipe(lambda r=reader: asyncio.StreamReaderProtocol(r), pipe)
                process._transports.append(transport)
            if stdin:
                transport, protocol = await loop.connect_write_pipe(asyncio.streams.FlowControlMixin, pipes[2])
                process._transports.append(transport)
                process.stdin = asyncio.StreamWriter(transport, protocol, None, loop)
        except BaseException:
            process.close()
            for pipe in pipes:
                pipe.close()
            process.kill()
            raise
        return process

    async def _start(
        self, loop: asyncio.AbstractEventLoop, run: dict, fds: list[int]
    ) -> tuple[int, int, asyncio.Future[int]]:
        started: asyncio.Future[int] = loop.create_future()
        exited: asyncio.Future[int] = loop.create_future()
        with self._lock:
            if self.lost:
                raise ZygoteLost(self.lost)
            run_id = next(self._ids)
            self._runs[run_id] = (loop, started, exited)
            message = json.dumps({"id": run_id, "run": run}).encode()
            if len(message) > MAX_MESSAGE:  # the run starts afresh; the zygote is fine
                del self._runs[run_id]
                raise ZygoteLost(f"a request of {len(message)} bytes is more than the zygote takes")
            try:
                socket.send_fds(self._sock, [message], fds, socket.MSG_DONTWAIT)
            except OSError as error:
                del self._runs[run_id]
                self._lose(f"the zygote took no more runs ({error})")
                raise ZygoteLost(self.lost) from error
        try:
            return run_id, await asyncio.wait_for(asyncio.shield(started), START_TIMEOUT_S), exited
        except asyncio.TimeoutError:
            self._lose(f"the zygote did not start a run within {START_TIMEOUT_S}s")
            raise ZygoteLost(self.lost) from None
        except asyncio.CancelledError:  # nobody will supervise this run: end it as soon as it exists
            started.add_done_callback(lambda f: f.cancelled() or f.exception() or self.kill(run_id))
            raise

    def kill(self, run_id: int) -> None:
        """Ask the zygote to SIGKILL a run's process group (nothing to do if the zygote is gone: its
        runs died with it)."""
        with self._lock, contextlib.suppress(OSError):
            if not self.lost:
                self._sock.send(json.dumps({"kill": run_id}).encode(), socket.MSG_DONTWAIT)

    def _read(self) -> None:
        """The reader thread: hand every answer to its run's loop until the zygote's socket ends; any
        other end of this thread (an answer that is not one) loses the zygote, so no run waits on it."""
        try:
            reason = self._read_answers()
        except Exception as error:  # noqa: BLE001  the thread's boundary: every failure is a loss
            reason = f"its answer could not be read ({type(error).__name__}: {error})"
        self._lose(f"the zygote was lost: {reason}")

    def _read_answers(self) -> str:
        while True:
            try:
                data = self._sock.recv(1 << 16)
            except OSError as error:
                return f"its socket failed ({error})"
            if not data:
                return f"it exited (status {self.process.poll()})"
            answer = json.loads(data)
            if not isinstance(answer, dict) or not isinstance(answer.get("id"), int):
                raise ValueError(f"not an answer: {data[:80]!r}")
            with self._lock:
                entry = self._runs.get(answer["id"])
                if entry is None:
                    continue
                if "returncode" in answer or "error" in answer:
                    del self._runs[answer["id"]]
            loop, started, exited = entry
            if "pid" in answer:
                _deliver(loop, started, int(answer["pid"]))
            elif "returncode" in answer:
                _deliver(loop, exited, int(answer["returncode"]))
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
