"""The router's ROUTER socket, driven directly by the event loop.

Every message of a rollout passes through the router twice, so its socket IO is the hot path of the
deployment. A zmq.asyncio socket costs a future and an event-loop round trip per message; this class
uses a plain (synchronous) pyzmq socket instead and only lets the event loop tell it when to look:

- receiving: the socket's file descriptor is watched with `loop.add_reader`; when it fires, `run()`
  takes every message already queued on the socket (up to `burst` of them or `BURST_S` seconds, then it
  yields so other tasks and timers run: a burst holds the loop that long at most, and then its sends) and hands each
  one to `on_message`, synchronously; what the handlers send meanwhile is held and sent, in order, when the
  burst ends, so a peer gets a burst's messages together (one wake-up for several) rather than one at a time
  (the first `burst` of them at once: the budget below is for fan-outs, not for a burst's forwards);
- sending: `send()` writes at once without blocking, for up to `SEND_S` seconds of a turn of the loop
  (a fan-out to a thousand replicas would hold it ~11 ms); past that, and at a peer's high-water mark
  (ROUTER_MANDATORY refuses the message on its first frame, never part-way), the message waits in an
  outbox, in order (every later one behind it: no message overtakes another), and a flush task sends
  it on the next turns, `SEND_S` seconds a turn, retrying while the peer has no room;
- fanning out (`fan_out`: one message to each of a thousand replicas): a slice of `FAN_OUT_SLICE` now and the
  next every `FAN_OUT_GAP_S`, so that libzmq's I/O thread, which encrypts and writes each, never holds a thousand
  in front of an answer sent meanwhile; a message to a peer whose copy still waits takes that copy with it, in
  front (each peer's messages keep their order);
- forgetting a peer (`forget`): a replacement that says Hello under its predecessor's identity first drops what
  still waits for that identity (a fan-out's copies, the outbox's, a burst's held sends): they were for the
  process that is gone, and the Welcome must be the first message the replacement gets;
- ZMQ's descriptor is edge-triggered: any operation on the socket (a send included) may consume the
  notification of messages that arrived meanwhile. So the receive loop re-reads ZMQ_EVENTS before it
  sleeps, and every send wakes it to do so.

An exception raised by `on_message` propagates out of `run()` (a supervised task: the actor stops); the flush and
fan-out tasks are started with `spawn` (the actor's: supervised too, so their failure stops the actor as well).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine
from typing import Any

import zmq

from mas_async.runtime.log_limit import LogLimit, printable

log = logging.getLogger("mas_async.router")

_NOBLOCK = int(zmq.NOBLOCK)
_MORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)
BURST_S = 0.0005
"""The most seconds one burst of received messages holds the event loop (then the next message waits a turn)."""
SEND_S = 0.0005
"""The most seconds of one turn of the loop in which messages are sent at once (the rest leave on the next turns)."""
FAN_OUT_SLICE = 64
"""A fan-out's messages sent together (`fan_out`): libzmq's I/O thread takes 10-20 us to encrypt and write each,
so a slice holds an answer sent after it ~1 ms in libzmq, where a thousand at once held it 12-20 ms."""
FAN_OUT_GAP_S = 0.001
"""Seconds between a fan-out's slices (so the I/O thread writes one slice before the next is handed to it)."""


Spawn = Callable[[Coroutine[Any, Any, None], str], asyncio.Task]
"""Starts a task of the socket's (the owner's supervised `Actor.spawn`)."""


def _create_task(coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task:
    return asyncio.get_running_loop().create_task(coro, name=name)


class RouterSocket:
    def __init__(
        self,
        sock: zmq.Socket,
        on_message: Callable[[list[zmq.Frame]], None],
        burst: int = 256,
        spawn: Spawn = _create_task,
    ) -> None:
        self.sock = sock
        self._spawn = spawn
        # pyzmq's own send, not the Python wrapper around it (which only adds routing-id and group arguments
        # the router never uses): a third less CPU per frame, and every forwarded message is four frames.
        base = zmq.backend.Socket
        self._send: Callable[..., object] = base.send.__get__(sock) if isinstance(sock, base) else sock.send
        self.on_message = on_message
        self.burst = burst
        self._wake = asyncio.Event()
        self._outbox: deque[list] = deque()
        self._flushing: asyncio.Task | None = None
        self._turn_began: float | None = None
        """When this turn of the loop sent its first message (None: it sent none yet)."""
        self._draining = False
        self._fanning: OrderedDict[bytes, list[list]] = OrderedDict()
        """identity -> the fan-outs' messages to it not sent yet, in order (`fan_out`)."""
        self._fan_task: asyncio.Task | None = None
        self._held: list[list] = []
        """What the handlers of the burst under way sent (it leaves when the burst ends)."""
        self.unsent = 0
        """Messages to an unknown or vanished identity (ROUTER_MANDATORY refused them; logged, rate-limited)."""
        self.forgotten = 0
        """Messages dropped unsent because their peer was replaced before they left (`forget`)."""
        self._warnings = LogLimit()

    async def run(self) -> None:
        """Receive until cancelled."""
        loop = asyncio.get_running_loop()
        fd = self.sock.getsockopt(zmq.FD)
        loop.add_reader(fd, self._wake.set)
        try:
            while True:
                self._wake.clear()
                if self.sock.getsockopt(_EVENTS) & _POLLIN:
                    if self._drain():  # a full burst: let the other tasks run, then go on
                        await asyncio.sleep(0)
                    continue
                await self._wake.wait()
        finally:
            loop.remove_reader(fd)
            for task in (self._flushing, self._fan_task):
                if task is not None:
                    task.cancel()

    def _drain(self) -> bool:
        """Hand over the queued messages; True when the burst ran out before the queue did."""
        sock = self.sock
        self._draining = True  # the receive loop re-reads ZMQ_EVENTS after this anyway
        until = time.perf_counter() + BURST_S
        try:
            for _ in range(self.burst):
                if time.perf_counter() > until:
                    return True
                try:
                    frames = [sock.recv(_NOBLOCK, copy=False)]
                except zmq.Again:
                    return False
                while frames[-1].more:  # the rest of a multipart message arrives with its first frame
                    frames.append(sock.recv(0, copy=False))
                self.on_message(frames)
            return True
        finally:
            held, self._held = self._held, []
            self._send_held(held)
            self._draining = False

    def _send_held(self, held: list[list]) -> None:
        """A burst's sends, at its end: the first `burst` of them at once, whatever this turn of the loop has sent
        (a burst handles at most `burst` messages, so a forwarded message never waits a turn, however long a
        preempted thread or the burst's own handlers took); the rest, a fan-out's, as `send` sends them."""
        for i, frames in enumerate(held):
            if i >= self.burst or self._outbox:
                self._send_or_queue(frames)
            elif not self._send_now(frames):
                self._queue(frames)

    def fan_out(self, identities: list[bytes], frames: list) -> None:
        """Send `frames` to each of `identities`: `FAN_OUT_SLICE` of them now, the next slice every `FAN_OUT_GAP_S`.
        A message sent meanwhile to a peer whose copy waits takes that copy with it, in front (each peer's messages
        keep their order); to any other peer it goes as it would, ahead of the fan-out's rest."""
        for identity in identities:
            self._fanning.setdefault(identity, []).append([identity, *frames])
        self._send_fan_slice()
        if self._fanning and (self._fan_task is None or self._fan_task.done()):
            try:
                asyncio.get_running_loop()
            except RuntimeError:  # no loop: nothing else waits on one
                while self._fanning:
                    self._send_fan_slice()
            else:
                self._fan_task = self._spawn(self._fan_rest(), "fan-out")

    def _send_fan_slice(self) -> None:
        for _ in range(min(FAN_OUT_SLICE, len(self._fanning))):
            for frames in self._fanning.popitem(last=False)[1]:
                self._send_or_hold(frames)

    def forget(self, identity: bytes) -> int:
        """Drop every message still waiting for `identity` (its fan-out copies, the outbox's, those held by the
        burst under way): the peer it was for is gone, and a replacement under the same identity must get its
        Welcome first. Returns how many were dropped (also counted in `forgotten`)."""
        dropped = len(self._fanning.pop(identity, ()))
        for name in ("_outbox", "_held"):
            waiting = getattr(self, name)
            kept = [frames for frames in waiting if bytes(frames[0]) != identity]
            dropped += len(waiting) - len(kept)
            if len(kept) != len(waiting):
                setattr(self, name, deque(kept) if name == "_outbox" else kept)
        self.forgotten += dropped
        return dropped

    async def _fan_rest(self) -> None:
        while self._fanning:
            await asyncio.sleep(FAN_OUT_GAP_S)
            self._send_fan_slice()

    def send(self, frames: list) -> None:
        """Send [identity, *frames] now, or queue it (in order) past this turn's `SEND_S` or while the peer is
        at its high-water mark."""
        if self._fanning and frames[0] in self._fanning:  # its fan-out copies first
            for earlier in self._fanning.pop(frames[0]):
                self._send_or_hold(earlier)
        self._send_or_hold(frames)

    def _send_or_hold(self, frames: list) -> None:
        """`send`, once no fan-out's copy waits for the peer."""
        if self._draining:
            self._held.append(frames)
            return
        self._send_or_queue(frames)

    def _send_or_queue(self, frames: list) -> None:
        """`send`, outside a burst."""
        if not self._outbox and self._in_turn_budget() and self._send_now(frames):
            return
        self._queue(frames)

    def _queue(self, frames: list) -> None:
        """Put the message in the outbox, behind every other, for the flush task."""
        self._outbox.append(frames)
        if self._flushing is None or self._flushing.done():
            self._flushing = self._spawn(self._flush(), "flush")

    def _in_turn_budget(self) -> bool:
        """Whether this turn of the loop has sent for less than `SEND_S` so far (always, with no loop running)."""
        now = time.perf_counter()
        if self._turn_began is None:
            try:
                asyncio.get_running_loop().call_soon(self._next_turn)
            except RuntimeError:  # no loop: nothing else waits on one
                return True
            self._turn_began = now
        return now - self._turn_began <= SEND_S

    def _next_turn(self) -> None:
        self._turn_began = None

    def _send_now(self, frames: list) -> bool:
        """False when the peer has no room (nothing was sent)."""
        send = self._send
        try:
            send(frames[0], _MORE_NOBLOCK, False)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:  # unknown or vanished peer (ROUTER_MANDATORY): logged, not fatal
            self.unsent += 1
            if n := self._warnings.due(e.errno):
                log.warning("could not send to %s: %s (%d such so far)", printable(bytes(frames[0])), e, n)
            return True
        else:
            last = len(frames) - 1
            for i in range(1, last + 1):
                send(frames[i], _MORE_NOBLOCK if i < last else _NOBLOCK, False)
            return True
        finally:
            if not self._draining:  # the send may have consumed the descriptor's notification
                self._wake.set()

    async def _flush(self) -> None:
        """Send the outbox in order, `SEND_S` seconds a turn of the loop; wait 1 ms while its first message's
        peer has no room."""
        while self._outbox:
            until = time.perf_counter() + SEND_S
            while self._outbox and time.perf_counter() <= until:
                if not self._send_now(self._outbox[0]):
                    await asyncio.sleep(0.001)
                    break
                self._outbox.popleft()
            else:
                await asyncio.sleep(0)
