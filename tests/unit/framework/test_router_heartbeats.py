"""The router's heartbeats: over each `heartbeat_s`, every live peer that was sent nothing else gets one, in
slices of the peers (a thousand peers' heartbeats are not one burst on the hot path); a lost peer gets none.
And a peer that sends anything is alive: its messages stamp it as a heartbeat does."""

from __future__ import annotations

import time

import pytest

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.router.hub import HEARTBEAT_SLICES, Router
from mas_async.wire.messages import PROTOCOL_VERSION, Heartbeat, Hello, Kind
from tests.support.paths import ROOT
from tests.unit.framework.test_router_refusals import _frames, _generate, _Sent

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)

WORKERS = 40
WORKER_NAMES = [f"env_worker/{i}".encode() for i in range(WORKERS)]


def _router_with_workers(tmp_path) -> Router:
    """A router (its socket a recorder) that every one of WORKERS env workers joined."""
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", [f"cluster.env_workers={WORKERS}"])
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 1}, {"vertical": "", "horizontal": ""})
    router = Router(config, deployment, tmp_path)
    router.io = _Sent()
    for ident in WORKER_NAMES:
        router._on_frames(_frames(ident, Hello("env_worker", ident.decode(), "", 4, PROTOCOL_VERSION, 1)))
    assert router.refused == 0 and len(router.peers) == WORKERS
    return router


def test_each_live_peer_gets_one_heartbeat_per_round_in_slices(tmp_path):
    router = _router_with_workers(tmp_path)
    workers = WORKER_NAMES
    lost, busy = workers[7], workers[12]
    router.table.mark_dead(lost)
    for ident in workers:
        router.sent_at[ident] -= router.cfg.cluster.heartbeat_s  # (their Welcomes: a heartbeat ago)
    router.send_to(busy, Heartbeat(0.0))  # (any message: it was just sent one)
    router.io.frames.clear()

    per_slice = []
    for part in range(HEARTBEAT_SLICES):
        before = len(router.io.frames)
        router._heartbeats(part)
        per_slice.append(len(router.io.frames) - before)
    sent = router.io.frames
    assert all(frames[1] == bytes([Kind.HEARTBEAT]) for frames in sent)
    to = sorted(frames[0] for frames in sent)
    live = sorted(ident for ident, info in router.peers.items() if info.alive and ident != busy)
    assert to == live and lost not in to and busy not in to  # each live idle peer once, the lost one never
    assert max(per_slice) <= -(-len(router.peers) // HEARTBEAT_SLICES)  # no slice holds more than its share


def test_any_message_of_a_peer_stamps_it_alive(tmp_path):
    router = _router_with_workers(tmp_path)
    ident = WORKER_NAMES[0]
    router.peers[ident].last_seen -= 100.0
    assert router.table.silent(time.monotonic(), 50.0) == [(ident, router.peers[ident])]
    router._on_frames(_frames(ident, _generate()))  # (no replica: answered with an error; the stamp is what counts)
    assert router.table.silent(time.monotonic(), 50.0) == []


def test_a_run_of_many_processes_heartbeats_less_often_within_the_peer_timeout(tmp_path, tiny_model):
    """`cluster.heartbeat_s` in a small run; in a large one processes / `cluster.heartbeats_per_s`, so the router
    takes in (and sends) at most that many heartbeats a second; never past a quarter of `peer_timeout_s`, never
    below heartbeat_s; the router and its peers use the same interval."""
    from mas_async.rollout.env_worker import EnvWorker

    def config(*overrides: str):
        return load_config(ROOT / "configs/plan_path_tiny.yaml", list(overrides))

    small = config()
    assert small.heartbeat_interval_s() == small.cluster.heartbeat_s == 1.0
    # 1,024 replicas of one policy, 1 of the other, 64 env workers, a trainer each: 1,091 processes.
    large = config("policies.vertical.replicas=1024", "cluster.env_workers=64")
    assert large.heartbeat_interval_s() == 1091 / 500
    assert config("policies.vertical.replicas=1024", "cluster.heartbeats_per_s=100").heartbeat_interval_s() == 30 / 4
    assert config("policies.vertical.replicas=1024", "cluster.heartbeat_s=9").heartbeat_interval_s() == 9
    paths = {"vertical": str(tiny_model), "horizontal": str(tiny_model)}
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 1}, paths)
    assert Router(large, deployment, tmp_path).heartbeat_s == 1091 / 500
    assert EnvWorker(large, deployment, 0).heartbeat_s == 1091 / 500
