"""The router's side of leases (`cluster.leases`), in-process with a recording socket: no lease before the run
starts, then every env worker gets each policy's live replicas with their endpoints, again whenever a set
changes (a replica lost, its replacement serving once it caught up) and a worker that joins later gets
them all; a replica without an endpoint is refused; the workers' counts reach the row (re-sent requests as
faults), a replacement's recovery ends when it is leased again, and the requests the router still routes
(a policy without a leased replica) are counted. Episodes' groups sent straight to the trainers: every
worker gets the trainers' endpoints, each training episode names the trainer rank of each policy (one per
problem, the problems spread over the ranks), and a done episode's samples are counted into its rank's step
and accepted to it in a batch before the TrainStep; a late attempt's never are."""

from __future__ import annotations

import asyncio
import time

import numpy as np
import zmq

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.metrics import Keys
from mas_async.router.hub import Router
from mas_async.wire.messages import (
    PROTOCOL_VERSION,
    Accepted,
    EpisodeDone,
    Generate,
    Groups,
    Hello,
    Lease,
    Message,
    RunEpisode,
    Trainers,
    TrainStep,
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

    def forget(self, identity: bytes) -> int:
        return 0  # every message left at once: nothing waits

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
    return f"tcp://10.0.0.{pid % 250}:{40000 + len(name)}"


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
    endpoint = _endpoint(name, pid) if endpoint is None and role != "env_worker" else (endpoint or "")
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
    assert router.leases is not None
    assert router.leases.take() == {Keys.DIRECT_REQUESTS: 7, Keys.STALE_RESULTS: 1, Keys.DIRECT_GROUPS: 0}
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


def test_episodes_name_their_trainer_ranks_and_done_ones_are_accepted_to_them_before_the_step(tmp_path):
    async def scenario() -> None:
        router = _router(tmp_path, "cluster.leases=true", "policies.vertical.trainer_ranks=2", "rollout.batch_size=3",
                         "algorithm.sampling=parallel", "algorithm.grouping=trajectory", "algorithm.k=2",
                         "rollout.episodes_per_worker=6")  # fmt: skip
        names = sorted(router.table.expected)
        for i, name in enumerate(names):
            _hello(router, name, 10 + i)
        trainers = [[n, _endpoint(n, 10 + names.index(n))] for n in names if n.startswith("trainer/")]
        sent = [(f[0], decode(f[1:])) for f in router.io.frames]
        assert [(who, m.endpoints) for who, m in sent if isinstance(m, Trainers)] == [(w, trainers) for w in WORKERS]
        router.io.frames.clear()
        iteration = asyncio.create_task(router._iteration(0, evaluate=False, train=True))
        await asyncio.sleep(0)
        runs = [(f[0], m) for f in router.io.frames if isinstance(m := decode(f[1:]), RunEpisode)]
        assert len(runs) == 6  # 3 problems x 2 episodes
        rank_of = {}
        for _, run in runs:
            assert set(run.trainer_ranks) == {"vertical"}  # (horizontal has one rank)
            assert rank_of.setdefault(run.problem_id, run.trainer_ranks["vertical"]) == run.trainer_ranks["vertical"]
        assert sorted(rank_of.values()) == [0, 0, 1]  # the problems spread over both ranks
        router.io.frames.clear()
        w0 = runs[0][0]
        router._peer_died(w0, router.peers[w0])  # its episodes run again as attempt 1, on the other worker
        lost = {run.episode_id for worker, run in runs if worker == w0}
        assert 0 < len(lost) < len(runs)
        for episode_id in lost:  # the lost worker's results come after all: never accepted
            late = EpisodeDone(episode_id, 0, "train", 0, "", {"success": 0.0}, {"vertical": 9, "horizontal": 9})
            router._on_frames(_frames(w0, late))
        pending, seen, reruns = [(w, r) for w, r in runs if w != w0], 0, []
        while pending:  # (a last attempt runs alone on its worker: the reruns come one by one)
            worker, run = pending.pop(0)
            counts = {"vertical": 3, "horizontal": 2}
            router._on_frames(_frames(worker, EpisodeDone(run.episode_id, 0, "train", run.attempt, "", {}, counts)))
            new = [(f[0], m) for f in router.io.frames[seen:] if isinstance(m := decode(f[1:]), RunEpisode)]
            seen = len(router.io.frames)
            pending += new
            reruns += new
        assert sorted(run.episode_id for _, run in reruns) == sorted(lost) and {run.attempt for _, run in reruns} == {1}
        await asyncio.sleep(0.01)
        sent = [(f[0], decode(f[1:])) for f in router.io.frames]
        accepted = {}
        for who, m in sent:
            if isinstance(m, Accepted):
                accepted.setdefault(who, []).extend((e[0], e[1], e[3]) for e in m.episodes)
        expected = {}
        for _, run in runs:
            attempt = 1 if run.episode_id in lost else 0
            rank = run.trainer_ranks["vertical"]
            expected.setdefault(f"trainer/vertical{'/1' if rank else ''}".encode(), []).append(
                (run.episode_id, attempt, 3)
            )
            expected.setdefault(b"trainer/horizontal", []).append((run.episode_id, attempt, 2))
        assert {who: sorted(e) for who, e in accepted.items()} == {who: sorted(e) for who, e in expected.items()}
        steps = {who: m.expected_samples for who, m in sent if isinstance(m, TrainStep)}
        assert steps == {who: sum(e[2] for e in entries) for who, entries in expected.items()}
        kinds = [type(m) for _, m in sent]
        assert max(i for i, k in enumerate(kinds) if k is Accepted) < kinds.index(TrainStep)
        assert router.leases is not None and router.leases.take()[Keys.DIRECT_GROUPS] == 12
        iteration.cancel()

    asyncio.run(scenario())


def test_groups_that_came_through_the_router_count_once_beside_those_sent_straight(tmp_path):
    """With leases a worker not (yet) linked to a trainer sends that policy's Groups through the router, which
    holds them and forwards them with the episode's EpisodeDone: those samples count into the step once, as
    forwarded groups, and are never `Accepted` as direct ones too (`EpisodeDone.samples` names them all)."""

    async def scenario() -> None:
        router = _router(tmp_path, "cluster.leases=true", "rollout.batch_size=2")
        _start(router)
        router.io.frames.clear()
        iteration = asyncio.create_task(router._iteration(0, evaluate=False, train=True))
        await asyncio.sleep(0)
        runs = [(f[0], m) for f in router.io.frames if isinstance(m := decode(f[1:]), RunEpisode)]
        assert len(runs) == 2
        (w0, routed), (w1, direct) = runs
        # Episode `routed`: vertical's groups through the router, horizontal's straight to its trainer.
        router._on_frames(_frames(w0, Groups("vertical", 0, routed.episode_id, routed.attempt, 3, 30, [], 1)))
        counts = {"vertical": 3, "horizontal": 2}
        router._on_frames(_frames(w0, EpisodeDone(routed.episode_id, 0, "train", routed.attempt, "", {}, counts)))
        router._on_frames(_frames(w1, EpisodeDone(direct.episode_id, 0, "train", direct.attempt, "", {}, counts)))
        await asyncio.sleep(0.01)
        sent = [(f[0], decode(f[1:])) for f in router.io.frames]
        accepted = sorted((who, e[0], e[3]) for who, m in sent if isinstance(m, Accepted) for e in m.episodes)
        assert accepted == sorted([(b"trainer/vertical", direct.episode_id, 3),
                                   (b"trainer/horizontal", routed.episode_id, 2),
                                   (b"trainer/horizontal", direct.episode_id, 2)])  # fmt: skip
        forwarded = [m.episode_id for who, m in sent if who == b"trainer/vertical" and isinstance(m, Groups)]
        assert forwarded == [routed.episode_id]
        steps = {who: m.expected_samples for who, m in sent if isinstance(m, TrainStep)}
        assert steps == {b"trainer/vertical": 6, b"trainer/horizontal": 4}
        iteration.cancel()

    asyncio.run(scenario())
