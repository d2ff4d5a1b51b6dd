"""The router with a sliced fan-out's copies still waiting (the real `RouterSocket`, its slices one peer wide and
far apart, over a socket that records what leaves): a replacement that says Hello under its predecessor's name
gets its Welcome first and never the predecessor's copy; the orders and Shutdowns sent meanwhile follow each
peer's copy, once each; a peer that gets something before its Welcome drops it and joins."""

from __future__ import annotations

import asyncio

import pytest
import uvloop
import zmq
import zmq.asyncio

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.router.hub import Router
from mas_async.runtime import router_socket
from mas_async.runtime.actor import Peer
from mas_async.runtime.router_socket import RouterSocket
from mas_async.wire.messages import (
    PROTOCOL_VERSION,
    Hello,
    Message,
    ReformWeightGroup,
    Shutdown,
    UpdateWeights,
    Welcome,
    decode,
    encode,
)
from tests.support.paths import ROOT

REPLICAS = [f"inference/horizontal/{i}".encode() for i in range(3)]
GAP_S = 0.05
"""Seconds between the fan-out's slices of one copy each: the window in which the tests act."""


class _Wire:
    """Stands in for the zmq socket under `RouterSocket`: records each whole message that leaves, in order."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []
        self.sent: list[tuple[bytes, Message]] = []

    def send(self, data, flags: int = 0, copy: bool = True) -> None:
        self.parts.append(bytes(data))
        if not flags & zmq.SNDMORE:
            identity, *body = self.parts
            self.parts = []
            self.sent.append((identity, decode(body)))

    def to(self, identity: bytes) -> list[Message]:
        return [msg for who, msg in self.sent if who == identity]


async def _router(tmp_path) -> tuple[Router, _Wire]:
    config = load_config(
        ROOT / "configs/plan_path_tiny.yaml",
        ["env.train_size=16", "env.test_size=4", "rollout.batch_size=2", "eval.size=2", "cluster.env_workers=1",
         "eval.baselines=false", "policies.horizontal.replicas=3"],
    )  # fmt: skip
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 3}, {"vertical": "", "horizontal": ""})
    router = Router(config, deployment, tmp_path)
    wire = _Wire()
    router.io = RouterSocket(wire, lambda frames: None)  # type: ignore[arg-type]
    peers = [b"env_worker/0", b"trainer/vertical", b"trainer/horizontal", b"inference/vertical/0", *REPLICAS]
    for ident in peers:
        role, _, rest = ident.decode().partition("/")
        router._on_hello(ident, Hello(role, ident.decode(), rest.split("/")[0] if role != "env_worker" else "", 1,
                                      PROTOCOL_VERSION, 1))  # fmt: skip
    while router.io._outbox:  # the Welcomes past the turn's send budget
        await asyncio.sleep(0.001)
    wire.sent.clear()
    return router, wire


@pytest.fixture
def sliced(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(router_socket, "FAN_OUT_SLICE", 1)
    monkeypatch.setattr(router_socket, "FAN_OUT_GAP_S", GAP_S)


def _update(router: Router) -> None:
    """The horizontal trainer's UpdateWeights, fanned out by the router: the first replica's copy leaves now, the
    others' wait for their slices."""
    router._handle(b"trainer/horizontal", UpdateWeights("horizontal", 1, 0))


def _run(scenario) -> None:
    uvloop.run(asyncio.wait_for(scenario(), 10.0))


def test_a_replacement_under_the_same_name_gets_its_welcome_first_and_not_its_predecessors_copy(tmp_path, sliced):
    async def scenario() -> None:
        router, wire = await _router(tmp_path)
        _update(router)
        replaced = REPLICAS[2]
        assert wire.to(replaced) == []  # its copy waits
        router._on_hello(replaced, Hello("inference", replaced.decode(), "horizontal", 1, PROTOCOL_VERSION, 2))
        await asyncio.sleep(5 * GAP_S)  # every slice gone
        got = wire.to(replaced)
        assert isinstance(got[0], Welcome), got
        assert not any(isinstance(m, UpdateWeights) for m in got), got
        assert router.io.forgotten == 1
        # The live replicas got their copy once each, before the re-form order the replacement caused.
        for ident in REPLICAS[:2]:
            kinds = [type(m) for m in wire.to(ident)]
            assert kinds.count(UpdateWeights) == 1, kinds
            if ReformWeightGroup in kinds:
                assert kinds.index(UpdateWeights) < kinds.index(ReformWeightGroup), kinds

    _run(scenario)


def test_an_order_to_a_peer_whose_copy_waits_follows_that_copy_once(tmp_path, sliced):
    async def scenario() -> None:
        router, wire = await _router(tmp_path)
        _update(router)
        order = ReformWeightGroup("horizontal", 1, [0, 1, 2], [])
        for ident in REPLICAS:
            router.send_to(ident, order)
        await asyncio.sleep(5 * GAP_S)
        for ident in REPLICAS:
            assert [type(m) for m in wire.to(ident)] == [UpdateWeights, ReformWeightGroup]

    _run(scenario)


def test_a_shutdown_during_a_fan_out_reaches_every_peer_last_and_once(tmp_path, sliced):
    async def scenario() -> None:
        router, wire = await _router(tmp_path)
        _update(router)
        router._peer_died(REPLICAS[1], router.peers[REPLICAS[1]])  # declared dead while its copy waits
        for ident in list(router.peers):  # the end of the run
            router.send_to(ident, Shutdown("run finished", False))
        await asyncio.sleep(5 * GAP_S)
        for ident in REPLICAS:
            got = wire.to(ident)
            shutdowns = [m for m in got if isinstance(m, Shutdown)]
            assert isinstance(got[-1], Shutdown) and [type(m) for m in got].count(UpdateWeights) == 1, got
            assert len(shutdowns) == (2 if ident == REPLICAS[1] else 1), got
        assert router.io.forgotten == 0  # nothing was replaced: nothing dropped

    _run(scenario)


def test_the_fan_out_task_is_supervised_by_its_owner(tmp_path, sliced):
    started: list[str] = []

    def spawn(coro, name: str) -> asyncio.Task:
        started.append(name)
        return asyncio.get_running_loop().create_task(coro, name=name)

    async def scenario() -> None:
        wire = _Wire()
        io = RouterSocket(wire, lambda frames: None, spawn=spawn)  # type: ignore[arg-type]
        io.fan_out(REPLICAS, encode(UpdateWeights("horizontal", 1, 0)))
        await asyncio.sleep(5 * GAP_S)
        assert [who for who, _ in wire.sent] == REPLICAS

    _run(scenario)
    assert started == ["fan-out"]


class _Joiner(Peer):
    async def main(self) -> None:  # pragma: no cover - setup alone is exercised
        await asyncio.sleep(0)


def test_a_peer_that_gets_a_message_before_its_welcome_drops_it_and_joins() -> None:
    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        peer = _Joiner("inference/horizontal/2", f"tcp://127.0.0.1:{port}", policy="horizontal",
                       startup_timeout_s=5.0)  # fmt: skip
        peer.ctx = ctx
        try:
            joining = asyncio.get_running_loop().create_task(peer.setup())
            identity, *hello = await router.recv_multipart()
            assert isinstance(decode(hello), Hello)
            await router.send_multipart([identity, *encode(UpdateWeights("horizontal", 1, 0))])  # the predecessor's
            await router.send_multipart([identity, *encode(Welcome(PROTOCOL_VERSION))])
            await asyncio.wait_for(joining, 5.0)
            assert peer.before_welcome == 1
        finally:
            for task in peer._tasks:
                task.cancel()
            await asyncio.gather(*peer._tasks, return_exceptions=True)
            ctx.destroy(linger=0)

    _run(scenario)
