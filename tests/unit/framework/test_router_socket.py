"""The router's socket driver: plain pyzmq calls woken by the event loop (real sockets on loopback)."""

from __future__ import annotations

import asyncio
import itertools
import time

import pytest
import uvloop
import zmq

from mas_async.runtime.router_socket import RouterSocket

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)

WAIT_S = 10.0


class Harness:
    """A ROUTER driven by RouterSocket and one DEALER peer named b"peer" (a plain blocking socket)."""

    def __init__(self, on_message=None, sndhwm: int = 1000) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.SNDHWM, sndhwm)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.peer = self.ctx.socket(zmq.DEALER)
        self.peer.setsockopt(zmq.IDENTITY, b"peer")
        self.peer.setsockopt(zmq.RCVHWM, sndhwm)
        self.peer.setsockopt(zmq.LINGER, 0)
        self.peer.connect(f"tcp://127.0.0.1:{port}")
        self.received: list[list[bytes]] = []
        self.arrived = asyncio.Event()
        self.io = RouterSocket(self.router, on_message or self._record, burst=4)

    def _record(self, frames: list) -> None:
        self.received.append([f.bytes for f in frames])
        self.arrived.set()

    async def wait_for(self, count: int) -> None:
        deadline = time.monotonic() + WAIT_S
        while len(self.received) < count:
            self.arrived.clear()
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"received {len(self.received)} of {count} messages in {WAIT_S}s")
            try:
                await asyncio.wait_for(self.arrived.wait(), remaining)
            except TimeoutError:
                continue

    async def receive(self, count: int) -> list[bytes]:
        """The first frame of each of the next `count` messages the peer gets (fewer after WAIT_S)."""
        got: list[bytes] = []
        deadline = time.monotonic() + WAIT_S
        while len(got) < count and time.monotonic() < deadline:
            try:
                got.append(self.peer.recv(zmq.NOBLOCK))
            except zmq.Again:
                await asyncio.sleep(0.001)  # let the loop's tasks (the flush) run
        return got

    def queue_on_socket(self, count: int) -> None:
        """Send `count` numbered messages and wait until they lie queued on the router's socket."""
        for i in range(count):
            self.peer.send_multipart([str(i).encode()])
        time.sleep(0.2)  # all of them queued on the socket before the loop looks

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def _run(coro) -> None:
    uvloop.run(asyncio.wait_for(coro, 3 * WAIT_S))


def test_many_messages_arrive_in_order_across_bursts() -> None:
    async def scenario() -> None:
        h = Harness()
        task = asyncio.create_task(h.io.run())
        try:
            for i in range(50):
                h.peer.send_multipart([b"k", str(i).encode()])
            await h.wait_for(50)
            assert [m[0] for m in h.received] == [b"peer"] * 50
            assert [int(m[2]) for m in h.received] == list(range(50))
        finally:
            task.cancel()
            h.close()

    _run(scenario())


def test_a_send_while_the_loop_waits_does_not_lose_the_next_arrival() -> None:
    """ZMQ's descriptor is edge-triggered: a send can consume the notification of a message that
    arrived meanwhile. Here a message is waiting on the socket, unannounced to the event loop, when
    another task sends; it must still be received (before the fix this hung until the next message)."""

    async def scenario() -> None:
        h = Harness()
        task = asyncio.create_task(h.io.run())
        try:
            h.peer.send_multipart([b"first"])
            await h.wait_for(1)
            h.peer.send_multipart([b"second"])
            time.sleep(0.2)  # blocking on purpose: the message reaches the socket, the loop does not run
            h.io.send([b"peer", b"reply"])  # another task's send, before the loop sees the descriptor
            await h.wait_for(2)
            assert h.received[1][1] == b"second"
            assert h.peer.poll(WAIT_S * 1000) and h.peer.recv_multipart() == [b"reply"]
        finally:
            task.cancel()
            h.close()

    _run(scenario())


def test_sends_past_the_high_water_mark_wait_in_order_and_all_arrive() -> None:
    async def scenario() -> None:
        h = Harness(sndhwm=2)
        task = asyncio.create_task(h.io.run())
        try:
            h.peer.send_multipart([b"hello"])  # the router learns the peer's identity
            await h.wait_for(1)
            for i in range(200):
                h.io.send([b"peer", str(i).encode()])
            assert h.io._outbox, "the high-water mark of 2 should have queued some messages"
            got = [int(m) for m in await h.receive(200)]
            assert got == list(range(200))
            assert not h.io._outbox
        finally:
            task.cancel()
            h.close()

    _run(scenario())


def test_an_error_in_the_handler_stops_run() -> None:
    def fail(frames: list) -> None:
        raise RuntimeError("handler failed on " + frames[1].bytes.decode())

    async def scenario() -> None:
        h = Harness(on_message=fail)
        try:
            h.peer.send_multipart([b"boom"])
            with pytest.raises(RuntimeError, match="handler failed on boom"):
                await asyncio.wait_for(h.io.run(), WAIT_S)
        finally:
            h.close()

    _run(scenario())


def test_a_burst_of_slow_messages_yields_to_the_loop_within_its_time_bound() -> None:
    """Handlers of 1 ms each and a burst of 256 messages: a burst stops after `BURST_S` seconds and other
    tasks (a timer) run between bursts; every message still arrives, in order."""
    from mas_async.runtime.router_socket import BURST_S

    def slow(frames: list) -> None:
        time.sleep(0.001)
        h._record(frames)

    async def scenario() -> None:
        task = asyncio.create_task(h.io.run())
        try:
            h.queue_on_socket(60)
            ticks: list[int] = []

            async def tick() -> None:
                while len(h.received) < 60:
                    ticks.append(len(h.received))
                    await asyncio.sleep(0)

            ticker = asyncio.create_task(tick())
            await h.wait_for(60)
            await ticker
            assert [int(m[1]) for m in h.received] == list(range(60))
            seen = sorted(set(ticks))  # how many had been handled each time the other task ran
            assert len(seen) >= 60 // (BURST_S / 0.001 + 2), seen  # it ran between bursts of a few, not once
            assert max(b - a for a, b in zip(seen, seen[1:], strict=False)) <= BURST_S / 0.001 + 2, seen
        finally:
            task.cancel()
            h.close()

    h = Harness(on_message=slow)
    h.io.burst = 256
    _run(scenario())


def test_a_fan_out_sends_for_its_time_bound_then_goes_on_in_later_turns_in_order() -> None:
    """2,000 sends in one turn of the loop (a weight update's notice to a thousand replicas, twice over): the
    socket sends for `SEND_S` seconds, queues the rest and sends it `SEND_S` a turn while other tasks run;
    a message sent meanwhile waits behind them; every one arrives once, in order."""

    async def scenario() -> None:
        h = Harness(sndhwm=10_000)
        task = asyncio.create_task(h.io.run())
        try:
            h.peer.send_multipart([b"hello"])
            await h.wait_for(1)
            await asyncio.sleep(0)  # a turn of its own
            for i in range(2000):
                h.io.send([b"peer", str(i).encode()])
            queued = len(h.io._outbox)
            assert 0 < queued < 2000, queued  # some went at once, the rest wait for the next turns
            turns = 0
            while h.io._outbox and turns < 100_000:
                turns += 1
                if turns == 2:
                    h.io.send([b"peer", b"later"])  # behind the queue, never ahead of it
                await asyncio.sleep(0)
            assert not h.io._outbox and turns >= 2, turns  # other tasks (this one) ran between the slices
            got = [m.decode() for m in await h.receive(2001)]
            assert got == [str(i) for i in range(2000)] + ["later"]
        finally:
            task.cancel()
            h.close()

    _run(scenario())


def test_the_sends_of_a_burst_leave_together_at_its_end_in_order() -> None:
    """What the handlers of a burst send is held until the burst ends, then sent in order: the peers get
    a burst's messages together (one wake-up for several) instead of one at a time; each arrives once."""
    events: list[tuple[str, int]] = []

    def echo(frames: list) -> None:
        i = int(frames[1].bytes)
        events.append(("handled", i))
        h.io.send([b"peer", str(i).encode()])

    async def scenario() -> None:
        send_now = h.io._send_now

        def recorded(frames: list) -> bool:
            events.append(("sent", int(frames[1])))
            return send_now(frames)

        h.io._send_now = recorded  # type: ignore[method-assign]
        task = asyncio.create_task(h.io.run())
        try:
            h.queue_on_socket(12)
            got = [int(m) for m in await h.receive(12)]
            assert got == list(range(12))
        finally:
            task.cancel()
            h.close()
        runs = [(kind, len(list(group))) for kind, group in itertools.groupby(kind for kind, _ in events)]
        # handled x n, then sent x n, burst after burst: never a send between two handlers of one burst
        assert [kind for kind, _ in runs] == ["handled", "sent"] * (len(runs) // 2), runs
        assert all(runs[i][1] == runs[i + 1][1] for i in range(0, len(runs), 2)), runs
        assert max(n for _, n in runs) >= 2, runs  # (burst=4: the 12 messages in bursts of several)
        assert [i for kind, i in events if kind == "sent"] == list(range(12))

    h = Harness(on_message=echo)
    _run(scenario())


def test_a_bursts_forwards_leave_at_once_even_past_the_turns_send_budget() -> None:
    """A burst's forwards are not a fan-out: with this turn's send budget spent (a thread preempted mid-turn, or
    the burst's own handlers' time), each still leaves at the burst's end, not a turn later through the outbox."""

    def forward(frames: list) -> None:
        h.io.send([b"peer", frames[1].bytes])

    async def scenario() -> None:
        task = asyncio.create_task(h.io.run())
        try:
            h.queue_on_socket(12)
            assert [int(m) for m in await h.receive(12)] == list(range(12))
            assert h.io._flushing is None and not h.io._outbox  # the outbox was never used
        finally:
            task.cancel()
            h.close()

    h = Harness(on_message=forward)
    h.io._in_turn_budget = lambda: False  # type: ignore[method-assign]  # every turn's budget spent already
    _run(scenario())


def test_a_fan_out_from_a_burst_sends_a_burst_at_once_and_the_rest_in_later_turns_in_order() -> None:
    """A handler that fans out (`burst` + 50 messages for one received): the first `burst` of the held sends leave
    at the burst's end, the 50 others wait in the outbox for the next turns (the budget bounds a fan-out); every
    one arrives once, in order."""
    queued_after_burst: list[int] = []

    def fan_out(frames: list) -> None:
        for i in range(h.io.burst + 50):
            h.io.send([b"peer", str(i).encode()])

    async def scenario() -> None:
        drain = h.io._drain

        def recorded() -> bool:
            full = drain()
            queued_after_burst.append(len(h.io._outbox))
            return full

        h.io._drain = recorded  # type: ignore[method-assign]
        task = asyncio.create_task(h.io.run())
        try:
            h.peer.send_multipart([b"go"])
            got = [int(m) for m in await h.receive(h.io.burst + 50)]
            assert got == list(range(h.io.burst + 50))
            assert queued_after_burst[0] == 50, queued_after_burst
        finally:
            task.cancel()
            h.close()

    h = Harness(on_message=fan_out)
    h.io._in_turn_budget = lambda: False  # type: ignore[method-assign]
    _run(scenario())


class Peers:
    """A ROUTER driven by RouterSocket and `count` DEALER peers named b"p0", b"p1", ..., each joined (the router has
    seen a message from it, so ROUTER_MANDATORY knows its identity)."""

    def __init__(self, count: int) -> None:
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.router.setsockopt(zmq.LINGER, 0)
        port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.names = [f"p{i}".encode() for i in range(count)]
        self.peers = {}
        for name in self.names:
            peer = self.ctx.socket(zmq.DEALER)
            peer.setsockopt(zmq.IDENTITY, name)
            peer.setsockopt(zmq.LINGER, 0)
            peer.connect(f"tcp://127.0.0.1:{port}")
            peer.send(b"hello")
            self.peers[name] = peer
        for _ in self.names:
            assert self.router.poll(int(WAIT_S * 1000)), "a peer never said hello"
            self.router.recv_multipart()
        self.io = RouterSocket(self.router, lambda frames: None)

    async def gather(self, count: int, wait_s: float = WAIT_S) -> list[tuple[bytes, bytes, float]]:
        """(peer, message, when it was read) of the next `count` messages, over all the peers, as they come (fewer
        after `wait_s`)."""
        got: list[tuple[bytes, bytes, float]] = []
        deadline = time.monotonic() + wait_s
        while len(got) < count and time.monotonic() < deadline:
            idle = True
            for name, peer in self.peers.items():
                try:
                    got.append((name, peer.recv(zmq.NOBLOCK), time.monotonic()))
                    idle = False
                except zmq.Again:
                    pass
            if idle:
                await asyncio.sleep(0.001)
        return got

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def test_a_fan_out_leaves_a_slice_at_a_time_each_peer_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """150 peers, slices of 50 every 0.1 s: 50 go at once, the other 100 wait; every peer gets its copy once, and the
    last slice cannot arrive before two gaps have passed. With no loop running, all of them go at once."""
    from mas_async.runtime import router_socket

    monkeypatch.setattr(router_socket, "FAN_OUT_SLICE", 50)
    monkeypatch.setattr(router_socket, "FAN_OUT_GAP_S", 0.1)
    h = Peers(150)

    async def scenario() -> None:
        began = time.monotonic()
        h.io.fan_out(h.names, [b"update"])
        assert len(h.io._fanning) == 100  # the first slice went, the rest waits
        got = await h.gather(150)
        assert sorted(name for name, _, _ in got) == sorted(h.names) and {m for _, m, _ in got} == {b"update"}
        assert max(at for _, _, at in got) - began >= 0.2  # the third slice, two gaps later
        assert not h.io._fanning and not await h.gather(1, wait_s=0.5)  # nothing more, nothing twice

    try:
        _run(scenario())
        h.io.fan_out(h.names, [b"again"])  # (no loop)
        assert not h.io._fanning
        got = uvloop.run(h.gather(150))
        assert sorted(name for name, _, _ in got) == sorted(h.names) and {m for _, m, _ in got} == {b"again"}
    finally:
        h.close()


def test_a_message_to_a_peer_whose_fan_out_copy_waits_follows_that_copy_and_overtakes_the_rest(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """During a fan-out in slices, a message to a peer still waiting for its copy takes the copy with it, in front
    (each peer's messages in order), and both leave before the fan-out's later slices; a message to a peer outside
    the fan-out leaves at once too."""
    from mas_async.runtime import router_socket

    monkeypatch.setattr(router_socket, "FAN_OUT_SLICE", 50)
    monkeypatch.setattr(router_socket, "FAN_OUT_GAP_S", 0.1)
    h = Peers(151)
    fanned, outside = h.names[:150], h.names[150]

    async def scenario() -> None:
        h.io.fan_out(fanned, [b"update"])
        h.io.send([b"p120", b"after"])
        h.io.send([outside, b"answer"])
        got = await h.gather(152)
        order = [(name, message) for name, message, _ in got]
        assert [m for name, m in order if name == b"p120"] == [b"update", b"after"]
        assert order.index((b"p120", b"after")) < order.index((b"p149", b"update"))  # ahead of the last slice
        assert order.index((outside, b"answer")) < order.index((b"p149", b"update"))
        assert sorted(name for name, _ in order) == sorted([*fanned, b"p120", outside])

    try:
        _run(scenario())
    finally:
        h.close()
