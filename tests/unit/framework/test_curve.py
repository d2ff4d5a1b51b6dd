"""CURVE on the run's sockets, with real sockets on 127.0.0.1 and no processes: the real `Router.setup`
(CURVE server, ZAP handler, refusal monitor) against real `Peer`s and raw DEALER sockets.

The run's keys are private (folder 0700, files 0600) and reused by a resumed run; a peer with the run's
keys joins and talks to the router; a plain client and one with a foreign key pair get nothing accepted,
each refusal is counted and logged (with the address when ZAP knows it) while the router keeps serving
the good peer; a peer the router refuses fails at once with `HandshakeFailed`, not at its timeout."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
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
from mas_async.runtime.actor import Peer
from mas_async.runtime.curve import generate_keys, prepare_keys, secure_client
from mas_async.runtime.handshakes import HandshakeFailed
from mas_async.wire.messages import PROTOCOL_VERSION, Hello, Message, Shutdown, encode
from tests.support.paths import ROOT

WAIT_S = 5.0
"""Bound of every wait in these tests; each normally takes milliseconds."""


def _config(*overrides: str):
    return load_config(
        ROOT / "configs/plan_path_tiny.yaml",
        ["env.train_size=4", "env.test_size=1", "cluster.env_workers=2", "cluster.heartbeat_s=0.2", *overrides],
    )


class _Worker(Peer):
    role = "env_worker"

    async def on_message(self, msg: Message) -> None:
        pass


@contextlib.asynccontextmanager
async def _deployment(run_dir: Path, keys_dir: str | None) -> AsyncIterator[tuple[Router, list[Peer]]]:
    """The real router's socket setup, bound on a free port of 127.0.0.1, and a list for the test's peers;
    all are torn down at the end whatever happened (a live context would hang the interpreter's exit).
    The router's tasks must not have failed."""
    endpoint = f"tcp://127.0.0.1:{free_ports('127.0.0.1', 1)[0]}"
    models = {"vertical": "", "horizontal": ""}
    deployment = Deployment(endpoint, {"vertical": 1, "horizontal": 2}, models, keys_dir=keys_dir)
    router = Router(_config(), deployment, run_dir)
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
    deadline = time.monotonic() + WAIT_S
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {WAIT_S}s: {what}")
        await asyncio.sleep(0.01)


def _foreign_keys(tmp_path: Path, run_keys: Path, *, keep: str) -> Path:
    """A keys folder of its own whose `keep` pair ("server" or "client") is copied from the run's."""
    keys = generate_keys(tmp_path / f"foreign-{keep}")
    for suffix in (".key", ".key_secret"):
        shutil.copy(run_keys / f"{keep}{suffix}", keys / f"{keep}{suffix}")
    return keys


def test_run_keys_are_private_and_a_resumed_run_reuses_them(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    keys_dir = Path(prepare_keys(_config(), run_dir) or "")
    assert keys_dir == run_dir / "keys"
    modes = {p.name: p.stat().st_mode & 0o777 for p in keys_dir.iterdir()}
    assert keys_dir.stat().st_mode & 0o777 == 0o700
    assert modes == {n: 0o600 for n in ("server.key", "server.key_secret", "client.key", "client.key_secret")}
    before = {p.name: p.read_bytes() for p in keys_dir.iterdir()}
    keys_dir.chmod(0o755)  # a resumed run's folder is made private again, its keys kept
    prepare_keys(_config(), run_dir)
    assert {p.name: p.read_bytes() for p in keys_dir.iterdir()} == before
    assert keys_dir.stat().st_mode & 0o777 == 0o700
    assert prepare_keys(_config("cluster.curve=false"), tmp_path / "plain") is None
    assert not (tmp_path / "plain").exists()


def test_router_serves_the_runs_peer_and_counts_and_logs_the_refused_ones(tmp_path, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="mas_async.handshakes")
    run_dir = tmp_path / "run"
    keys_dir = prepare_keys(_config(), run_dir)
    assert keys_dir is not None
    foreign = _foreign_keys(tmp_path, Path(keys_dir), keep="server")  # knows the router's public key only

    async def main() -> None:
        ctx = zmq.asyncio.Context()
        ctx.linger = 0  # an intruder's Hello is never delivered: a socket lingering on it would block term()
        try:
            await _serve_and_refuse(ctx)
        finally:
            ctx.destroy(linger=0)

    async def _serve_and_refuse(ctx: zmq.asyncio.Context) -> None:
        async with _deployment(run_dir, keys_dir) as (router, peers):
            good = _Worker("env_worker/0", router.deployment.router_endpoint, keys_dir=keys_dir)
            peers.append(good)
            await _join(good)  # Hello decoded by the router, Welcome back
            assert b"env_worker/0" in router.peers
            intruders = []
            for keys in (None, foreign):
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.IDENTITY, b"env_worker/1")
                if keys is not None:
                    secure_client(sock, keys)
                sock.connect(router.deployment.router_endpoint)
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
    assert any("from 127.0.0.1" in line and "not the run's client key" in line for line in lines), lines
    plain = ("do not both use CURVE", "closed during the handshake")  # whichever end hangs up first
    assert any(any(reason in line for reason in plain) for line in lines), lines


@pytest.mark.parametrize("case", ["plain", "foreign client key", "foreign router key"])
def test_a_refused_peer_fails_with_a_named_error_at_once(tmp_path: Path, case: str) -> None:
    run_dir = tmp_path / "run"
    keys_dir = prepare_keys(_config(), run_dir)
    assert keys_dir is not None
    peer_keys = {
        "plain": None,
        "foreign client key": str(_foreign_keys(tmp_path, Path(keys_dir), keep="server")),
        "foreign router key": str(_foreign_keys(tmp_path, Path(keys_dir), keep="client")),
    }[case]

    async def main() -> float:
        async with _deployment(run_dir, keys_dir) as (router, peers):
            peer = _Worker("env_worker/0", router.deployment.router_endpoint, keys_dir=peer_keys, startup_timeout_s=60)
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
