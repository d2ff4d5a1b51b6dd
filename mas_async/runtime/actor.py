"""The actor runtime: one asyncio (uvloop) event loop per process, pyzmq asyncio sockets, supervised tasks.

`Actor` is the base of every process role. It owns the ZMQ context and the tasks of the process; if
any task raises, the others are cancelled and the error propagates to the process entry point (a dead
peer or a failed handler is a named error, never a hang). Teardown closes every socket and terminates
the context with a hard timeout before the process exits: zero-copy sends crash a process that exits
with a live context.

`Peer` is an actor with one DEALER socket connected to the router (a CURVE client when the deployment
has keys: `mas_async.runtime.curve`). Its life: connect, send Hello (role, id, policy, capacity, protocol
version, when it replaces a lost process, when that one was found dead, and an inference replica's direct
endpoint with `cluster.leases`), wait for Welcome (a refused handshake is `HandshakeFailed`, not a hang),
then run its work while a heartbeat task sends a Heartbeat every `heartbeat_s` in which it sent nothing
else (any message says it is alive) and declares the router dead after `peer_timeout_s` of silence.
Socket IO lives in its own tasks: the receive task decodes and dispatches, the send task drains a queue,
so handlers never await a socket. Blocking calls (torch compute, torch.distributed collectives) go to
threads with `asyncio.to_thread`; the loop keeps serving heartbeats meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import signal
import time
from collections.abc import Coroutine
from typing import Any

import uvloop
import zmq
import zmq.asyncio

from mas_async.runtime.curve import secure_client
from mas_async.runtime.handshakes import HandshakeWatch
from mas_async.runtime.log_limit import LogLimit
from mas_async.wire.codec import MAX_FRAME_BYTES, CodecError
from mas_async.wire.messages import (
    PROTOCOL_VERSION,
    Heartbeat,
    Hello,
    Message,
    Shutdown,
    Welcome,
    decode,
    encode,
)

log = logging.getLogger("mas_async")

PARENT_PID_ENV = "MAS_ASYNC_PARENT_PID"
"""Set by an engine that starts a process (the pid of the starter): a process orphaned before its actor is
built would otherwise take its new parent (init) for the one to watch, and outlive the run."""

DIED_AT_ENV = "MAS_ASYNC_DIED_AT"
"""Set by the launcher when it restarts a lost process: the unix time its predecessor was found dead. The
process says it in its Hello, so the router knows a replacement (and times its recovery)."""


class PeerDead(RuntimeError):
    """A peer (or the router) stayed silent past the timeout."""


class Actor:
    """Base of every process: owns the event loop's tasks, the ZMQ context and the shutdown path."""

    role: str = "actor"

    def __init__(self, peer_id: str) -> None:
        self.peer_id = peer_id
        self.ctx: zmq.asyncio.Context | None = None
        self.stopping = asyncio.Event()
        self.malformed = 0
        """Messages dropped because they could not be decoded (a logged counter, never a crash)."""
        self.warnings = LogLimit()
        """Rate limit of warnings that a flood of bad messages would repeat (`mas_async.runtime.log_limit`)."""
        self._tasks: list[asyncio.Task] = []
        self._parent_pid = int(os.environ.get(PARENT_PID_ENV) or os.getppid())

    # -- to implement ------------------------------------------------------------------------------

    async def setup(self) -> None:
        """Create sockets and connect; runs before `main` (the parent watch and a stop already apply)."""

    async def main(self) -> None:
        """The actor's work; the process stops when it returns."""
        await self.stopping.wait()

    async def cleanup(self) -> None:
        """Release resources other than sockets (those close with the context)."""

    # -- runtime -----------------------------------------------------------------------------------

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task:
        """Start a supervised task: if it raises, the whole actor stops with that error."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.append(task)
        return task

    def stop(self) -> None:
        self.stopping.set()

    async def _watch_parent(self) -> None:
        # If the launcher dies (even by SIGKILL) our parent changes: never outlive the deployment.
        while True:
            await asyncio.sleep(1.0)
            if os.getppid() != self._parent_pid:
                log.warning("parent process %d is gone; shutting down", self._parent_pid)
                self.stop()
                return

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop)
        self.ctx = zmq.asyncio.Context()
        try:
            # The parent is watched (and a stop obeyed) from the start: a process orphaned while it sets up
            # (its peers gone) must not wait out its startup timeouts.
            self.spawn(self._watch_parent(), "watch-parent")
            stop = loop.create_task(self.stopping.wait())
            setup = self.spawn(self.setup(), "setup")
            await asyncio.wait([setup, stop], return_when=asyncio.FIRST_COMPLETED)
            if not setup.done():
                return
            setup.result()
            main = self.spawn(self.main(), "main")
            while True:
                done, _ = await asyncio.wait([*self._tasks, stop], return_when=asyncio.FIRST_COMPLETED)
                failed = [t for t in done if t is not stop and not t.cancelled() and t.exception()]
                if failed:
                    raise failed[0].exception()  # type: ignore[misc]
                if main in done or stop in done:
                    break
                self._tasks = [t for t in self._tasks if not t.done()]
            stop.cancel()
        finally:
            await self._teardown()

    async def _teardown(self) -> None:
        for task in self._tasks:
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.gather(*self._tasks, return_exceptions=True), timeout=5.0)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.cleanup(), timeout=10.0)
        if self.ctx is not None:
            # linger bounds how long unsent messages may delay exit; term() must run before exit.
            self.ctx.destroy(linger=500)

    def run(self) -> None:
        """Process entry: run the actor to completion on uvloop."""
        uvloop.run(self._run())


def make_socket(ctx: zmq.asyncio.Context, kind: int, identity: str | None = None) -> zmq.asyncio.Socket:
    """A socket with the project's common options: frames above MAX_FRAME_BYTES are refused by ZMQ
    itself, high-water marks are generous (10k messages: the barrier bounds what is in flight, so a
    full queue means a stuck peer and blocks the sender rather than dropping), and linger is short."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.RCVHWM, 10_000)
    sock.setsockopt(zmq.LINGER, 500)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    return sock


class Peer(Actor):
    """An actor connected to the router by one DEALER socket (env worker, inference server, trainer).

    Socket: DEALER connected to the router's ROUTER socket. Messages to the router are never dropped by
    ZMQ (DEALER blocks at the high-water mark). The ready barrier against slow joiners is the Hello/Welcome
    exchange: nothing but Hello is sent before Welcome arrives. With `keys_dir` (the deployment's) the
    socket is a CURVE client holding this process's own key pair (`curve_secret`, else the one the
    launcher gave the process), which names it at the router; its socket identity is then
    peer_id#<random>, new for every connection, so no other connection can guess it and take the router's
    messages to this process over. Without keys the identity is peer_id (ROUTER_HANDOVER lets a
    replacement take it over).
    """

    def __init__(
        self,
        peer_id: str,
        router_endpoint: str,
        *,
        policy: str = "",
        capacity: int = 0,
        heartbeat_s: float = 1.0,
        peer_timeout_s: float = 30.0,
        startup_timeout_s: float = 300.0,
        keys_dir: str | None = None,
        curve_secret: str | None = None,
    ) -> None:
        super().__init__(peer_id)
        self.router_endpoint = router_endpoint
        self.policy = policy
        self.capacity = capacity
        self.heartbeat_s = heartbeat_s
        self.peer_timeout_s = peer_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self.keys_dir = keys_dir
        self.curve_secret = curve_secret
        self._outbox: asyncio.Queue[list[bytes]] = asyncio.Queue()
        self._router_seen = time.monotonic()
        self._sent_at = float("-inf")
        """When the last message was queued for the router (time.monotonic())."""
        self.sock: zmq.asyncio.Socket | None = None
        self.before_welcome = 0
        """Messages from the router dropped because they came before its Welcome (`_await_welcome`)."""
        self.endpoint = ""
        """Where this process takes messages of its own (an inference replica's direct socket with
        `cluster.leases`), said in its Hello; set before `setup` runs. "": nowhere but from the router."""

    async def setup(self) -> None:
        assert self.ctx is not None
        identity = self.peer_id if self.keys_dir is None else f"{self.peer_id}#{secrets.token_hex(8)}"
        self.sock = make_socket(self.ctx, zmq.DEALER, identity)
        if self.keys_dir is not None:
            secure_client(self.sock, self.keys_dir, self.curve_secret)
        handshakes = HandshakeWatch(self.sock, self.router_endpoint, self.keys_dir)
        try:
            self.sock.connect(self.router_endpoint)
            await self.sock.send_multipart(
                encode(
                    Hello(
                        self.role,
                        self.peer_id,
                        self.policy,
                        self.capacity,
                        PROTOCOL_VERSION,
                        os.getpid(),
                        float(os.environ.get(DIED_AT_ENV) or 0.0),
                        self.endpoint,
                    )  # fmt: skip
                )
            )
            if not await handshakes.wait_readable(self.startup_timeout_s):
                failed = f" ({handshakes.failures} handshake(s) closed by the router)" if handshakes.failures else ""
                raise PeerDead(
                    f"no Welcome from the router at {self.router_endpoint} in {self.startup_timeout_s}s{failed}"
                )
        finally:
            handshakes.close()
        await self._await_welcome()
        self._router_seen = time.monotonic()
        self.spawn(self._receive_loop(), "receive")
        self.spawn(self._send_loop(), "send")
        self.spawn(self._heartbeat_loop(), "heartbeat")
        log.info("connected to router at %s", self.router_endpoint)

    async def _await_welcome(self) -> None:
        """Take the router's messages until its Welcome, within `startup_timeout_s`. Anything before the Welcome
        was addressed to a predecessor under this identity (a copy that waited in the router while it was
        replaced): it is dropped and counted, not obeyed and not fatal; what this process needs comes after the
        Welcome (a catch-up order). An undecodable message is dropped the same way."""
        assert self.sock is not None
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            try:
                frames = await asyncio.wait_for(self.sock.recv_multipart(), max(remaining, 0.0))
            except TimeoutError:
                raise PeerDead(
                    f"no Welcome from the router at {self.router_endpoint} in {self.startup_timeout_s}s "
                    f"({self.before_welcome} other message(s) dropped meanwhile)"
                ) from None
            try:
                reply = decode(frames)
            except CodecError as e:
                reply = e
            if isinstance(reply, Welcome):
                return
            self.before_welcome += 1
            log.warning(
                "dropped a %s from the router before its Welcome (it was for a predecessor under this name)",
                type(reply).__name__,
            )

    def send(self, msg: Message) -> None:
        """Queue a message for the router (never blocks the caller)."""
        self.send_frames(encode(msg))

    def send_frames(self, frames: list) -> None:
        """Queue an encoded message for the router (never blocks the caller)."""
        self._outbox.put_nowait(frames)
        self._sent_at = time.monotonic()

    async def _send_loop(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self._outbox.get()
            await self.sock.send_multipart(frames, copy=False)

    async def _receive_loop(self) -> None:
        assert self.sock is not None
        while True:
            frames = await self.sock.recv_multipart(copy=False)
            self._router_seen = time.monotonic()
            try:
                msg = decode([f.buffer for f in frames])
            except CodecError as e:
                self.malformed += 1
                if n := self.warnings.due("malformed"):
                    log.warning("dropped a malformed message from the router (%d so far): %s", n, e)
                continue
            if isinstance(msg, Heartbeat):
                continue
            if isinstance(msg, Shutdown):
                if msg.failed:  # e.g. declared dead after a silence: exit non-zero, so the launcher restarts it
                    raise PeerDead(f"the router stopped this process: {msg.reason}")
                log.info("shutdown requested by the router: %s", msg.reason)
                self.stop()
                continue
            await self.on_message(msg)

    async def _heartbeat_loop(self) -> None:
        while True:
            if time.monotonic() - self._sent_at >= self.heartbeat_s:
                self.send(Heartbeat(time.time()))
            await asyncio.sleep(self.heartbeat_s)
            silent = time.monotonic() - self._router_seen
            if silent > self.peer_timeout_s:
                raise PeerDead(f"the router has been silent for {silent:.0f}s")

    async def on_message(self, msg: Message) -> None:
        """Handle one decoded message from the router; must not block (spawn tasks for long work)."""
        raise NotImplementedError(f"{type(self).__name__} does not handle {type(msg).__name__}")

    def unexpected(self, msg: Message) -> None:
        """A message of a kind this role does not take: dropped, with a rate-limited warning."""
        if n := self.warnings.due(("unexpected", type(msg))):
            log.warning("dropped an unexpected %s from the router (%d so far)", type(msg).__name__, n)
