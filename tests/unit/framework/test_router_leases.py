"""The router's side of leases (`cluster.leases`), in-process with a recording socket: no lease before the run
starts, then every env worker gets each policy's live replicas with their endpoints, again whenever a set
changes (a replica lost, its replacement serving once it caught up) and a worker that joins later gets
them all; a replica without an endpoint is refused; the workers' counts reach the row (re-sent requests as
faults), a replacement's recovery ends when it is leased again, and the requests the router still routes
(a policy without a leased replica) are counted."""

from __future__ import annotations

import time

import numpy as np
import zmq

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.metrics import Keys
from mas_async.router.hub import Router
from mas_async.wire.messages import (
    PROTOCOL_VERSION,
    EpisodeDone,
    Generate,
    Hello,
    Lease,
    Message,
    WeightsLoaded,
    decode,
    encode,
)
from tests.support.paths import ROOT

WORKERS = (b"env_worker/0", b"env_worker/1")
V0, V1, H0 = "inference/vertical/0", "inference/vertical/1", "inference/horizontal/0"


class _Sent:
    def __init__(self) -> None:
        self.frames: list[list] = []

    def send(self, frames: list) -> None:
        self.frames.append(frames)

    def leases(self) -> dict[bytes, list[tuple[str, list]]]:
        """(policy, replicas) of every Lease sent, by recipient, in order; the record starts again."""
        out: dict[bytes, list[tuple[str, list]]] = {}
        for frames in self.frames:
            msg = decode(frames[1:])
            if isinstance(msg, Lease):
                out.setdefault(frames[0], []).append((msg.policy, msg.replicas))
        self.frames.clear()
        return out


def _endpoint(name: str, pid: int) -> str:
    return f"tcp://10.0.0.{pid % 250}:{40000 + int(name[-1])}"


def _router(tmp_path, *overrides: str) -> Router:
    config = load_config(
        ROOT / "configs/plan_path_tiny.yaml",
        ["rollout.batch_size=4", "cluster.env_workers=2", "policies.vertical.replicas=2", *overrides],
    )
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, {"vertical": "", "horizontal": ""})
    router = Router(config, deployment, tmp_path)
    router.io = _Sent()
    return router


def _hello(router: Router, name: str, pid: int, died_at: float = 0.0, endpoint: str | None = None) -> None:
    role = name.split("/")[0]
    policy = name.split("/")[1] if role != "env_worker" else ""
    endpoint = _endpoint(name, pid) if endpoint is None and role == "inference" else (endpoint or "")
    msg = Hello(role, name, policy, 4, PROTOCOL_VERSION, pid, died_at, endpoint)
    router._on_frames([zmq.Frame(name.encode()), *(zmq.Frame(f) for f in encode(msg))])


def _start(router: Router) -> None:
    for i, name in enumerate(["trainer/vertical", "trainer/horizontal", V0, V1, H0, "env_worker/0"]):
        _hello(router, name, 10 + i)
    assert router.io.leases() == {}  # the run has not started: no lease yet
    _hello(router, "env_worker/1", 20)
    assert router.all_joined.is_set()


def _frames(identity: bytes, msg: Message) -> list[zmq.Frame]:
    return [zmq.Frame(identity), *(zmq.Frame(f) for f in encode(msg))]


def test_every_worker_gets_each_policy_s_live_replicas_when_the_run_starts_and_whenever_they_change(tmp_path):
    router = _router(tmp_path, "cluster.leases=true")
    _start(router)
    both = [
        (("vertical", [[V0, _endpoint(V0, 12)], [V1, _endpoint(V1, 13)]])),
        ("horizontal", [[H0, _endpoint(H0, 14)]]),
    ]
    assert router.io.leases() == {worker: both for worker in WORKERS}

    died = time.time() - 2.0
    router._on_restarted(V0, 12, died)  # the launcher's word: lost
    assert router.io.leases() == {worker: [("vertical", [[V1, _endpoint(V1, 13)]])] for worker in WORKERS}
    _hello(router, V0, 99, died)  # the replacement joined; it serves once it holds the version the others serve
    assert router.io.leases() == {}
    router._handle(V0.encode(), WeightsLoaded("vertical", 0, V0, ""))
    again = [("vertical", [[V0, _endpoint(V0, 99)], [V1, _endpoint(V1, 13)]])]
    assert router.io.leases() == {worker: again for worker in WORKERS}
    row = router.faults.take()
    assert row[Keys.restarts("inference")] == 1 and 2.0 <= row[Keys.RECOVERY_S] < 30  # leased again: recovered

    _hello(router, "env_worker/1", 21, time.time() - 1.0)  # a replaced env worker gets every lease at once
    assert router.io.leases() == {WORKERS[1]: again + both[1:]}


def test_a_replica_without_an_endpoint_is_refused_when_leases_are_on(tmp_path):
    router = _router(tmp_path, "cluster.leases=true")
    _hello(router, V0, 12, endpoint="")
    _hello(router, V1, 13, endpoint="ipc:///tmp/x")
    assert router.refused == 2 and not router.peers
    plain = _router(tmp_path)  # without leases an endpoint is neither needed nor leased
    _hello(plain, V0, 12, endpoint="")
    assert plain.refused == 0 and V0.encode() in plain.peers and plain.leases is None


def test_the_workers_counts_reach_the_row_and_routed_requests_are_counted(tmp_path):
    router = _router(tmp_path, "cluster.leases=true")
    _start(router)
    router.io.leases()
    counts = {"direct": 7, "resent": 2, "stale": 1}
    router._on_frames(_frames(WORKERS[0], EpisodeDone("train0-0", 0, "train", 0, "", {}, {}, counts)))
    bad = {"direct": -1}
    router._on_frames(_frames(WORKERS[1], EpisodeDone("train0-1", 0, "train", 0, "", {}, {}, bad)))
    assert router.refused == 1  # (counts that are not counts: dropped; the episode is taken all the same)
    assert router.leases is not None and router.leases.take() == {Keys.DIRECT_REQUESTS: 7, Keys.STALE_RESULTS: 1}
    assert router.faults.take()[Keys.REISSUED_REQUESTS] == 2
    generate = Generate(5, "vertical", "env_worker/0", time.time() + 60, np.arange(3, dtype=np.int32), 1, 4, 1.0, 1.0,
                        False, [])  # fmt: skip
    router._on_frames(_frames(WORKERS[0], generate))  # a policy with no replica leased: through the router
    assert router.routed == 1 and [f[0] for f in router.io.frames] == [V0.encode()]


def test_without_leases_no_lease_is_sent(tmp_path):
    router = _router(tmp_path)
    _start(router)
    router._on_restarted(V0, 12, time.time())
    assert router.io.leases() == {} and router.leases is None


def test_each_worker_is_leased_a_share_and_every_replica_is_leased_as_often_as_any_other():
    """`share`: `lease_replicas` replicas per worker (all when fewer), ceil(R / W) when that is more, so a
    thousand replicas are split among the workers, each replica some worker's, none more often than another."""
    from mas_async.router.leases import share

    assert share(0, 1, 2, 4) == {0, 1}  # fewer replicas than the size: all of them
    assert share(3, 8, 8, 4) == {3, 4, 5, 6}  # consecutive from the worker's place in the ring
    assert share(7, 8, 8, 4) == {7, 0, 1, 2}  # (the ring wraps)
    for replicas, workers, size in [(1024, 64, 4), (1024, 100, 4), (256, 16, 4), (64, 64, 4), (6, 4, 2)]:
        shares = [share(w, workers, replicas, size) for w in range(workers)]
        count = max(size, -(-replicas // workers))
        assert all(len(s) == min(replicas, count) for s in shares)
        leased = [sum(r in s for s in shares) for r in range(replicas)]
        assert min(leased) >= 1, "every replica is some worker's"
        assert max(leased) - min(leased) <= 1, (replicas, workers, size, sorted(set(leased)))
