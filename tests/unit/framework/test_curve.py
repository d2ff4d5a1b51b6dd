"""CURVE on the run's sockets, with real sockets on 127.0.0.1 and no processes: the real `Router.setup`
(CURVE server, ZAP handler, refusal monitor) against real `Peer`s and raw DEALER sockets.

Every process has a key pair of its own, made at each start of the run; only public keys are written (a
private folder, 0600). A peer with its own key joins and talks to the router; a plain client and one with a
foreign key pair get nothing accepted, each refusal is counted and logged (with the address when ZAP knows
it) while the router keeps serving the good peer; a peer the router refuses fails at once with
`HandshakeFailed`, not at its timeout. A key is one process: with env_worker/0's key, a Hello as
trainer/vertical is refused and counted, a socket named after the trainer neither speaks for it nor takes
its messages, and a second connection of a joined peer's key is not heard."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import uvloop
import zmq
import zmq.asyncio

from mas_async.config import load_config
from mas_async.deployment import Deployment, free_ports
from mas_async.router.hub import Router
from mas_async.runtime import curve
from mas_async.runtime.actor import Peer
from mas_async.runtime.curve import SECRET_ENV, generate_keys, own_secret, prepare_keys, secure_client
from mas_async.runtime.handshakes import HandshakeFailed
from mas_async.wire.messages import PROTOCOL_VERSION, Hello, Message, Shutdown, Trained, encode
from tests.support.paths import ROOT
from tests.support.run_keys import issue_keys, until

WAIT_S = 5.0
"""Bound of every wait in these tests; each normally takes milliseconds."""
NAMES = ["router", "trainer/vertical", "trainer/horizontal", "env_worker/0", "env_worker/1"]


def _config(*overrides: str):
    return load_config(
        ROOT / "configs/plan_path_tiny.yaml",
        ["env.train_size=4", "env.test_size=1", "cluster.env_workers=2", "cluster.heartbeat_s=0.2", *overrides],
    )


def _keys(run_dir: Path) -> tuple[str, dict[str, str]]:
    return issue_keys(_config(), run_dir, NAMES)


class _Worker(Peer):
    role = "env_worker"

    async def on_message(self, msg: Message) -> None:
        pass


class _Trainer(Peer):
    role = "trainer"

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.got: list[Message] = []

    async def on_message(self, msg: Message) -> None:
        self.got.append(msg)


@contextlib.asynccontextmanager
async def _deployment(
    run_dir: Path, keys_dir: str | None, router_secret: str | None = None
) -> AsyncIterator[tuple[Router, list[Peer]]]:
    """The real router's socket setup, bound on a free port of 127.0.0.1, and a list for the test's peers;
    all are torn down at the end whatever happened (a live context would hang the interpreter's exit).
    The router's tasks must not have failed."""
    endpoint = f"tcp://127.0.0.1:{free_ports('127.0.0.1', 1)[0]}"
    models = {"vertical": "", "horizontal": ""}
    deployment = Deployment(endpoint, {"vertical": 1, "horizontal": 2}, models, keys_dir=keys_dir)
    router = Router(_config(), deployment, run_dir, curve_secret=router_secret)
    router.ctx = zmq.asyncio.Context()
    peers: list[Peer] = []
    try:
        await router.setup()
        yield router, peers
        failed = [t for t in router._tasks if t.done() and not t.cancelled() and t.exception()]
        assert not failed, failed[0].exception()
    finally:
        for peer in peers:
            await peer._teardown()
        await router._teardown()


async def _join(peer: Peer) -> None:
    """Run the peer's setup (Hello, then Welcome) in its own context."""
    peer.ctx = zmq.asyncio.Context()
    await asyncio.wait_for(peer.setup(), WAIT_S)


async def _until(condition, what: str) -> None:
    await until(condition, what, WAIT_S)


def test_each_process_has_its_own_key_and_no_secret_is_written(tmp_path: Path, monkeypatch) -> None:
    run_dir = tmp_path / "run"
    keys_dir, secrets = _keys(run_dir)
    assert Path(keys_dir) == run_dir / "keys" and Path(keys_dir).stat().st_mode & 0o777 == 0o700
    assert [p.name for p in Path(keys_dir).iterdir()] == ["public.json"]
    assert (Path(keys_dir) / "public.json").stat().st_mode & 0o777 == 0o600
    public = json.loads((Path(keys_dir) / "public.json").read_text())
    assert sorted(public["peers"]) == sorted(NAMES[1:])  # the router's is apart: it is no client
    assert len({*secrets.values()}) == len(NAMES)
    for name, secret in secrets.items():  # each public key is its secret's, and no secret is on disk
        key = public["router"] if name == "router" else public["peers"][name]
        assert zmq.curve_public(secret.encode()).decode() == key
        assert secret not in (Path(keys_dir) / "public.json").read_text()
    Path(keys_dir).chmod(0o755)  # a new start of the run: the folder made private again, new keys
    _, again = _keys(run_dir)
    assert Path(keys_dir).stat().st_mode & 0o777 == 0o700 and not set(again.values()) & set(secrets.values())
    assert prepare_keys(_config("cluster.curve=false"), tmp_path / "plain", NAMES) is None
    assert not (tmp_path / "plain").exists()
    # A process takes its own key from its environment once, and leaves none there for what it starts.
    monkeypatch.setattr(curve, "_own", None)
    monkeypatch.setenv(SECRET_ENV, secrets["env_worker/0"])
    assert own_secret() == secrets["env_worker/0"] and SECRET_ENV not in __import__("os").environ
    assert own_secret() == secrets["env_worker/0"]


def test_router_serves_the_runs_peer_and_counts_and_logs_the_refused_ones(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="mas_async.handshakes")
    run_dir = tmp_path / "run"
    keys_dir, secrets = _keys(run_dir)
    foreign = zmq.curve_keypair()[1].decode()  # a key pair of its own: the router's public key is no secret

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        ctx.linger = 0  # an intruder's Hello is never delivered: a socket lingering on it would block term()
        try:
            await _serve_and_refuse(ctx)
        finally:
            ctx.destroy(linger=0)

    async def _serve_and_refuse(ctx: zmq.asyncio.Context) -> None:
        async with _deployment(run_dir, keys_dir, secrets["router"]) as (router, peers):
            endpoint = router.deployment.router_endpoint
            good = _Worker("env_worker/0", endpoint, keys_dir=keys_dir, curve_secret=secrets["env_worker/0"])
            peers.append(good)
            await _join(good)  # Hello decoded by the router, Welcome back
            assert b"env_worker/0" in router.peers
            intruders = []
            for key in (None, foreign):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.IDENTITY, b"env_worker/1")
                if key is not None:
                    secure_client(sock, keys_dir, key)
                sock.connect(endpoint)
                await sock.send_multipart(encode(Hello("env_worker", "env_worker/1", "", 1, PROTOCOL_VERSION, 1)))
                intruders.append(sock)
            await _until(lambda: router.refusals.count >= 2, "both intruders refused")
            # The router still serves the run's peer, and its message reaches it.
            router.send_to(b"env_worker/0", Shutdown("test", False))
            await asyncio.wait_for(good.stopping.wait(), WAIT_S)
            assert b"env_worker/1" not in router.peers
            assert [await s.poll(0) for s in intruders] == [0, 0]  # no Welcome, nothing at all

    uvloop.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "mas_async.handshakes"]
    assert any("from 127.0.0.1" in line and "not one of the run's processes'" in line for line in lines), lines
    plain = ("do not both use CURVE", "closed during the handshake")  # whichever end hangs up first
    assert any(any(reason in line for reason in plain) for line in lines), lines


def test_a_key_speaks_only_for_the_process_it_was_issued_to(tmp_path, caplog) -> None:
    """A process holding env_worker/0's key (an env worker's node, a program that escaped its sandbox): its
    Hello as trainer/vertical is refused and counted; a socket it names "trainer/vertical" cannot speak for
    the trainer once the trainer joined, nor take the router's messages to it; and a second connection with
    the joined env worker's own key is not heard either. The real peers are served throughout."""
    caplog.set_level(logging.WARNING, logger="mas_async.router")
    run_dir = tmp_path / "run"
    keys_dir, secrets = _keys(run_dir)

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        ctx.linger = 0
        try:
            async with _deployment(run_dir, keys_dir, secrets["router"]) as (router, peers):
                await _impersonate(ctx, router, peers)
        finally:
            ctx.destroy(linger=0)

    async def _impersonate(ctx: zmq.asyncio.Context, router: Router, peers: list[Peer]) -> None:
        endpoint = router.deployment.router_endpoint
        stolen = secrets["env_worker/0"]

        async def rogue(identity: bytes) -> zmq.asyncio.Socket:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, identity)
            secure_client(sock, keys_dir, stolen)
            sock.connect(endpoint)
            return sock

        first = await rogue(b"trainer/vertical")
        await first.send_multipart(encode(Hello("trainer", "trainer/vertical", "vertical", 0, PROTOCOL_VERSION, 7)))
        await _until(lambda: router.refused == 1, "the Hello as the trainer refused")
        assert not router.peers and await first.poll(200) == 0  # no Welcome
        trainer = _Trainer("trainer/vertical", endpoint, policy="vertical", keys_dir=keys_dir,
                           curve_secret=secrets["trainer/vertical"])  # fmt: skip
        worker = _Worker("env_worker/0", endpoint, keys_dir=keys_dir, curve_secret=stolen)
        peers += [trainer, worker]
        await _join(trainer)
        await _join(worker)
        assert {b"trainer/vertical", b"env_worker/0"} <= set(router.peers)
        # The rogue socket named after the trainer speaks as env_worker/0 (its key), over a connection that
        # env_worker/0 did not join with; and a second one with the worker's own name is not heard either.
        second = await rogue(b"env_worker/0")
        for sock in (first, second):
            await sock.send_multipart(encode(Trained("vertical", 1, "", {})))
        await _until(lambda: router.refused == 3, "both rogue messages refused")
        router.send_to(b"trainer/vertical", Shutdown("only the trainer may read this", False))
        await asyncio.wait_for(trainer.stopping.wait(), WAIT_S)
        assert [await s.poll(200) for s in (first, second)] == [0, 0]

    uvloop.run(main())
    lines = [r.getMessage() for r in caplog.records if r.name == "mas_async.router"]
    assert any("dropped a Hello from env_worker/0: its peer_id or role is not its sender's (its key's)" in line
               for line in lines), lines  # fmt: skip
    assert any("another connection than the one its sender joined with" in line for line in lines), lines


@pytest.mark.parametrize("case", ["plain", "foreign client key", "foreign router key"])
def test_a_refused_peer_fails_with_a_named_error_at_once(tmp_path: Path, case: str) -> None:
    run_dir = tmp_path / "run"
    keys_dir, secrets = _keys(run_dir)
    other_run = tmp_path / "other" / "keys"
    other = generate_keys(other_run, NAMES)  # another run's keys: its router's public key is not this one's
    peer_keys, secret = {
        "plain": (None, None),
        "foreign client key": (keys_dir, other["env_worker/0"]),
        "foreign router key": (str(other_run), secrets["env_worker/0"]),
    }[case]

    async def main() -> float:
        async with _deployment(run_dir, keys_dir, secrets["router"]) as (router, peers):
            peer = _Worker("env_worker/0", router.deployment.router_endpoint, keys_dir=peer_keys, curve_secret=secret,
                           startup_timeout_s=60)  # fmt: skip
            peers.append(peer)
            start = time.monotonic()
            with pytest.raises(HandshakeFailed, match="refused this process's ZeroMQ handshake"):
                await _join(peer)
            assert not router.peers
            return time.monotonic() - start

    assert uvloop.run(main()) < WAIT_S  # not the 60 s startup timeout


def test_with_curve_off_the_sockets_are_plain(tmp_path: Path) -> None:
    async def main() -> None:
        async with _deployment(tmp_path, None) as (router, peers):
            peer = _Worker("env_worker/0", router.deployment.router_endpoint)
            peers.append(peer)
            await _join(peer)
            assert b"env_worker/0" in router.peers and router.refusals.count == 0

    uvloop.run(main())
