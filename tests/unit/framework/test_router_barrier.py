"""The router's barrier and episode book without processes: a fake socket records what the router
sends, and the test plays the peers. Groups reach a trainer only once their episode is done; a result
of an abandoned attempt (a worker declared dead, then late) is dropped and counted, never forwarded
twice; a timed-out or failed eval episode counts as a failure; TrainStep carries the exact count; the
next iteration waits for every Trained and WeightsLoaded."""

from __future__ import annotations

import asyncio
import time

import pytest

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.router.hub import Router
from mas_async.wire.messages import (
    HEADERS,
    PROTOCOL_VERSION,
    EpisodeDone,
    Groups,
    Hello,
    RunEpisode,
    Trained,
    TrainStep,
    UpdateWeights,
    WeightsLoaded,
    Withdrawn,
    decode,
    encode,
)
from tests.support.paths import ROOT

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)

WORKERS = (b"env_worker/0", b"env_worker/1")
TRAINERS = (b"trainer/vertical", b"trainer/horizontal")
REPLICAS = (b"inference/vertical/0", b"inference/horizontal/0")


class _Sent:
    """Stands in for the router's socket: records (identity, message) of everything sent."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, object]] = []

    def forget(self, identity: bytes) -> int:
        return 0  # every message left at once: nothing waits

    def send(self, frames: list) -> None:
        self.sent.append((frames[0], decode([bytes(f) for f in frames[1:]])))

    def fan_out(self, identities: list[bytes], frames: list) -> None:
        for identity in identities:
            self.send([identity, *frames])

    def of(self, cls: type) -> list[tuple[bytes, object]]:
        return [(who, msg) for who, msg in self.sent if isinstance(msg, cls)]


def _router(tmp_path, *overrides: str) -> Router:
    config = load_config(
        ROOT / "configs/plan_path_tiny.yaml",
        ["env.train_size=16", "env.test_size=4", "rollout.batch_size=2", "eval.size=2", "cluster.env_workers=2",
         "rollout.episodes_per_worker=1", "eval.baselines=false", *overrides],
    )  # fmt: skip
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, {"vertical": "", "horizontal": ""})
    router = Router(config, deployment, tmp_path)
    router.io = _Sent()
    for ident in (*WORKERS, *TRAINERS, *REPLICAS):
        role = ident.decode().split("/")[0]
        policy = ident.decode().split("/")[1] if role != "env_worker" else ""
        router._on_hello(ident, Hello(role, ident.decode(), policy, 1, PROTOCOL_VERSION, 1))
    router.io.sent.clear()  # the Welcomes
    return router


def _groups(router: Router, run: RunEpisode, policy: str, n: int, attempt: int | None = None) -> None:
    attempt = run.attempt if attempt is None else attempt
    msg = Groups(policy, run.iteration, run.episode_id, attempt, n, n, [])
    frames = encode(msg)
    router._hold_groups(WORKERS[0], HEADERS[msg.KIND](*[getattr(msg, f) for f in HEADERS[msg.KIND]._fields]), frames)


def _done(router: Router, worker: bytes, run: RunEpisode, *, success: bool = True, error: str = "", attempt=None):
    attempt = run.attempt if attempt is None else attempt
    summary = {} if error else {"success": success, "tokens": 3, "turns": 1}
    router._handle(worker, EpisodeDone(run.episode_id, run.iteration, run.mode, attempt, error, summary, {}))


def _finish_step(router: Router, version: int) -> None:
    for trainer in TRAINERS:
        policy = trainer.decode().split("/")[1]
        router._handle(trainer, Trained(policy, version, "", {"time/train_s": 0.1, "time/weight_sync_s": 0.0}))
    for replica in REPLICAS:
        router._handle(replica, WeightsLoaded(replica.decode().split("/")[1], version, replica.decode(), ""))


def test_groups_wait_for_their_episode_and_a_late_attempt_is_never_forwarded(tmp_path):
    async def scenario() -> dict:
        router = _router(tmp_path, "algorithm.std_scope=agent")  # (groups that do not stream by turn)
        assert not router.streams_turns
        iteration = asyncio.create_task(router._iteration(0, evaluate=False, train=True))
        await asyncio.sleep(0)
        runs = router.io.of(RunEpisode)
        assert sorted(w for w, _ in runs) == sorted(WORKERS)  # one episode per worker (capacity 1)
        (w0, run0), (w1, run1) = runs
        _groups(router, run0, "vertical", 4)
        _groups(router, run0, "horizontal", 4)
        assert not [w for w, _ in router.io.sent if w.startswith(b"trainer/")]  # held until done
        # Worker 1 is declared dead: its episode runs again as attempt 1 (on worker 0, once it is free).
        router.peers[w1].last_seen = time.monotonic() - 10 * router.cfg.cluster.peer_timeout_s
        router._peer_died(w1, router.peers[w1])
        _done(router, w0, run0)
        rerun = router.io.of(RunEpisode)[-1][1]
        assert rerun.episode_id == run1.episode_id and rerun.attempt == 1
        # The "dead" worker was only slow: its groups and result of attempt 0 arrive late.
        _groups(router, run1, "vertical", 4)
        _done(router, w1, run1)
        _groups(router, rerun, "vertical", 4)
        _groups(router, rerun, "horizontal", 4)
        _done(router, w0, rerun)
        await asyncio.sleep(0)
        steps = {w: m for w, m in router.io.of(TrainStep)}
        assert steps[b"trainer/vertical"].expected_samples == 8  # not 12: attempt 0 of run1 is dropped
        assert steps[b"trainer/horizontal"].expected_samples == 8
        forwarded = [w for w, _ in router.io.sent if w.startswith(b"trainer/")]
        assert forwarded.count(b"trainer/vertical") == 2 + 1  # two episodes' groups, one TrainStep
        assert not iteration.done()  # the barrier waits for every Trained and WeightsLoaded
        _finish_step(router, 1)
        row = await asyncio.wait_for(iteration, 5)
        assert router.clock.version == 1
        return row

    row = asyncio.run(scenario())
    assert row["router/late_groups"] == 2 and row["rollout/episodes"] == 2 and row["rollout/dropped"] == 0


def test_groups_streamed_by_turn_go_at_once_and_those_of_a_failed_or_abandoned_attempt_are_withdrawn(tmp_path):
    """`Config.streams_turns` (the tiny demo's default): each Groups goes to its trainer as it comes; when the
    attempt's worker is declared dead, and when an episode fails, the trainers that got its groups are told
    (`Withdrawn`), the attempt's late groups are dropped, and only done attempts count into the step."""

    async def scenario() -> tuple[dict, list]:
        router = _router(tmp_path, "env.train_size=16", "rollout.batch_size=3")
        assert router.streams_turns
        iteration = asyncio.create_task(router._iteration(0, evaluate=False, train=True))
        await asyncio.sleep(0)
        (w0, run0), (w1, run1) = router.io.of(RunEpisode)
        _groups(router, run0, "vertical", 4)
        _groups(router, run1, "vertical", 4)
        _groups(router, run1, "horizontal", 4)
        forwarded = [w for w, m in router.io.sent if isinstance(m, Groups)]
        assert forwarded == [b"trainer/vertical", b"trainer/vertical", b"trainer/horizontal"]  # not held
        router.peers[w1].last_seen = time.monotonic() - 10 * router.cfg.cluster.peer_timeout_s
        router._peer_died(w1, router.peers[w1])  # run1's attempt 0 is abandoned
        _groups(router, run0, "horizontal", 4)
        _done(router, w0, run0)
        run2 = router.io.of(RunEpisode)[-1][1]  # (worker 0 runs one episode at a time: the plan's next first)
        assert run2.episode_id == "train0-2"
        _groups(router, run2, "vertical", 4)
        _done(router, w0, run2, error="ValueError: boom")
        rerun = router.io.of(RunEpisode)[-1][1]
        assert rerun.episode_id == run1.episode_id and rerun.attempt == 1
        _groups(router, run1, "vertical", 4)  # the "dead" worker was slow: late, dropped
        _groups(router, rerun, "vertical", 4)
        _done(router, w0, rerun)
        await asyncio.sleep(0)
        withdrawn = [(w, m.episode_id, m.attempt) for w, m in router.io.of(Withdrawn)]
        steps = {w: m.expected_samples for w, m in router.io.of(TrainStep)}
        _finish_step(router, 1)
        return await asyncio.wait_for(iteration, 5), [withdrawn, steps]

    row, (withdrawn, steps) = asyncio.run(scenario())
    assert withdrawn == [
        (b"trainer/horizontal", "train0-1", 0), (b"trainer/vertical", "train0-1", 0), (b"trainer/vertical", "train0-2", 0),
    ]  # fmt: skip
    assert steps == {b"trainer/vertical": 8, b"trainer/horizontal": 4}  # run0's and the rerun's
    assert row["router/late_groups"] == 1 and row["rollout/episodes"] == 2 and row["rollout/dropped"] == 1


def test_failed_and_timed_out_eval_episodes_count_as_failures(tmp_path):
    async def scenario() -> dict:
        router = _router(tmp_path, "rollout.episodes_per_worker=2")
        iteration = asyncio.create_task(router._iteration(0, evaluate=True, train=False))
        await asyncio.sleep(0)
        (w0, run0), (w1, run1) = router.io.of(RunEpisode)
        _done(router, w0, run0, success=True)
        for task in router.books[0].in_flight.values():  # run1 passes its deadline
            task.deadline = 0.0
        for task in router.books[0].overdue(time.monotonic()):
            m = task.msg
            router._on_episode_done(EpisodeDone(m.episode_id, m.iteration, m.mode, m.attempt, "timed out", {}, {}))
        _done(router, w1, run1, success=True)  # too late: dropped, not counted as a success
        return await asyncio.wait_for(iteration, 5)

    row = asyncio.run(scenario())
    assert row["eval/team_success_rate"] == 0.5 and row["eval/dropped"] == 1 and row["eval/episodes"] == 1
    assert row["eval/pass@1"] == 0.5 and row["router/late_groups"] == 1


@pytest.mark.parametrize("streamed", [True, False], ids=["streamed", "held"])
def test_a_failed_training_episode_sends_no_samples_and_counts_as_a_failure(tmp_path, streamed):
    """Groups streamed by turn reach the trainer at once and are withdrawn when their episode fails; groups
    held until the episode is done (std_scope agent: no streaming by turn) never leave the router."""

    async def scenario() -> dict:
        router = _router(tmp_path, *([] if streamed else ["algorithm.std_scope=agent"]))
        assert router.streams_turns is streamed
        iteration = asyncio.create_task(router._iteration(0, evaluate=False, train=True))
        await asyncio.sleep(0)
        (w0, run0), (w1, run1) = router.io.of(RunEpisode)
        _groups(router, run0, "vertical", 4)
        _done(router, w0, run0, error="ValueError: boom")
        _groups(router, run1, "vertical", 2)
        _done(router, w1, run1, success=True)
        await asyncio.sleep(0)
        steps = {w: m for w, m in router.io.of(TrainStep)}
        assert steps[b"trainer/vertical"].expected_samples == 2
        # What reached the trainer of the failed episode: its groups and their withdrawal, or nothing.
        failed = [type(m) for w, m in router.io.sent
                  if w == b"trainer/vertical" and getattr(m, "episode_id", "") == run0.episode_id]  # fmt: skip
        assert failed == ([Groups, Withdrawn] if streamed else [])
        _finish_step(router, 1)
        return await asyncio.wait_for(iteration, 5)

    row = asyncio.run(scenario())
    assert row["team/success_rate"] == 0.5 and row["rollout/dropped"] == 1


def test_a_better_evaluation_checkpoints_the_evaluated_weights_and_records_the_best(tmp_path):
    from mas_async.checkpoint import load_best

    async def iteration(router: Router, number: int, successes: tuple[bool, bool]) -> TrainStep:
        task = asyncio.create_task(router._iteration(number, evaluate=True, train=True))
        await asyncio.sleep(0)
        for _ in range(2):  # the two eval episodes, then the two training episodes
            for (worker, run), success in zip(router.io.of(RunEpisode)[-2:], successes, strict=True):
                if run.episode_id in router.books[number].in_flight:
                    _done(router, worker, run, success=success)
            await asyncio.sleep(0)
        step = router.io.of(TrainStep)[-1][1]
        _finish_step(router, number + 1)
        await asyncio.wait_for(task, 5)
        return step

    async def scenario() -> list[bool]:
        router = _router(tmp_path, "rollout.episodes_per_worker=1", "trainer.checkpoint_every=0")
        flags = []
        for number, successes in enumerate([(True, False), (False, False), (True, True)]):
            flags.append((await iteration(router, number, successes)).checkpoint_first)
            router.io.sent.clear()
        return flags

    flags = asyncio.run(scenario())
    assert flags == [True, False, True]  # 0.5 is a new best, 0.0 is not, 1.0 is
    assert load_best(tmp_path) == {"version": 2, "score": 1.0}
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "router").glob("v*.json")) == [
        "v000000.json", "v000002.json"]  # fmt: skip


def test_bounded_staleness_runs_the_next_iteration_during_the_step_but_not_its_evaluation(tmp_path):
    """k=1: iteration 1's training episodes start while step 0 runs, iteration 2's only once v1 is held;
    iteration 1's evaluation waits for v1 (it measures those weights); samples of iteration 1 are counted
    for the step from v1, not mixed into step 0."""

    def sent_runs(router: Router) -> set[tuple[int, str]]:
        return {(m.iteration, m.mode) for _, m in router.io.of(RunEpisode)}

    async def scenario() -> None:
        router = _router(tmp_path, "rollout.max_staleness=1", "eval.every=1", "run.iterations=3")
        for worker in WORKERS:
            router.peers[worker].capacity = 8
        first = asyncio.create_task(router._iteration(0, **router._plan(0)))
        await asyncio.sleep(0)
        assert sent_runs(router) == {(0, "train"), (0, "eval"), (1, "train")}
        for worker, run in router.io.of(RunEpisode):
            if run.iteration == 0:
                _groups(router, run, "vertical", 3) if run.mode == "train" else None
                _done(router, worker, run)
            else:
                _groups(router, run, "vertical", 5)
                _done(router, worker, run)  # iteration 1 finishes during step 0
        await asyncio.sleep(0)
        steps = router.io.of(TrainStep)
        assert [(m.version, m.expected_samples) for w, m in steps if w == b"trainer/vertical"] == [(0, 6)]
        assert (1, "eval") not in sent_runs(router) and (2, "train") not in sent_runs(router)
        _finish_step(router, 1)
        await asyncio.wait_for(first, 5)
        assert {(1, "eval"), (2, "train")} <= sent_runs(router) and (2, "eval") not in sent_runs(router)
        assert router.clock.expected_samples("vertical", 1) == 10

    asyncio.run(scenario())


def _two_rank_router(tmp_path, capacity: int, *overrides: str) -> Router:
    """A router with 2 trainer ranks for policy vertical (3 training problems an iteration, 2 env workers of
    `capacity` episodes each), every peer joined."""
    config = load_config(
        ROOT / "configs/plan_path_tiny.yaml",
        ["env.train_size=16", "env.test_size=4", "rollout.batch_size=3", "cluster.env_workers=2",
         f"rollout.episodes_per_worker={capacity}", "policies.vertical.trainer_ranks=2", *overrides],
    )  # fmt: skip
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, {"vertical": "", "horizontal": ""})
    router = Router(config, deployment, tmp_path)
    router.io = _Sent()
    for name in sorted(router.table.expected):
        role, policy = name.split("/")[0], (name.split("/")[1] if not name.startswith("env_worker") else "")
        router._on_hello(name.encode(), Hello(role, name, policy, capacity, PROTOCOL_VERSION, 1))
    router.io.sent.clear()
    return router


def test_trainer_ranks_get_whole_episodes_and_the_step_waits_for_every_rank(tmp_path):
    async def scenario() -> dict:
        # (groups by episode: balanced by the tokens forwarded)
        router = _two_rank_router(tmp_path, 2, "algorithm.std_scope=agent")
        assert b"trainer/vertical/1" in {n.encode() for n in router.table.expected} and not router.streams_turns
        iteration = asyncio.create_task(router._iteration(0, evaluate=False, train=True))
        await asyncio.sleep(0)
        runs = router.io.of(RunEpisode)
        assert len(runs) == 3
        for (worker, run), n in zip(runs, (8, 4, 4), strict=True):  # n samples of n tokens per policy
            _groups(router, run, "vertical", n)
            _groups(router, run, "vertical", n)  # a second group of the same episode: same rank
            _groups(router, run, "horizontal", n)
            _done(router, worker, run)
        await asyncio.sleep(0)
        to = [w for w, m in router.io.sent if isinstance(m, Groups)]
        # Episode 0 (16 tokens) to rank 0, then episodes 1 and 2 (8 each) to rank 1, the lighter one;
        # every group of an episode goes to the same rank.
        assert (to.count(b"trainer/vertical"), to.count(b"trainer/vertical/1"), to.count(b"trainer/horizontal")) == (
            2, 4, 3,
        )  # fmt: skip
        steps = {w: m.expected_samples for w, m in router.io.of(TrainStep)}
        assert steps == {b"trainer/vertical": 16, b"trainer/vertical/1": 16, b"trainer/horizontal": 16}
        _finish_step(router, 1)
        await asyncio.sleep(0.05)
        assert not iteration.done()  # rank 1 of vertical has not reported
        router._handle(b"trainer/vertical/1", Trained("vertical", 1, "", {}))
        row = await asyncio.wait_for(iteration, 5)
        assert router.clock.version == 1
        return row

    row = asyncio.run(scenario())
    assert row["rollout/episodes"] == 3


def test_groups_streamed_by_turn_spread_over_the_trainer_ranks_by_problem(tmp_path):
    """Groups streamed by turn come before any episode is done (no sample counts as a rank's load yet): each
    problem's first group picks the rank with the fewest problems, and its later groups follow it."""

    async def scenario() -> list[bytes]:
        router = _two_rank_router(tmp_path, 2)
        assert router.streams_turns
        iteration = asyncio.create_task(router._iteration(0, evaluate=False, train=True))
        await asyncio.sleep(0)
        runs = [run for _, run in router.io.of(RunEpisode)]
        for turn in range(2):
            for run in runs:
                _groups(router, run, "vertical", 4 + turn)
        iteration.cancel()
        return [w for w, m in router.io.sent if isinstance(m, Groups)]

    to = asyncio.run(scenario())
    rank0, rank1 = b"trainer/vertical", b"trainer/vertical/1"
    assert to == [rank0, rank1, rank0, rank0, rank1, rank0]


def test_under_parallel_sampling_every_episode_of_a_problem_goes_to_one_trainer_rank(tmp_path):
    """Parallel sampling runs K episodes per problem, and the problem's advantages are relative to all of
    them (trajectory and agent groupings): whichever rank is the lighter one when a later episode is done,
    it goes where the problem's first one went."""

    async def scenario() -> None:
        router = _two_rank_router(
            tmp_path, 12, "algorithm.sampling=parallel", "algorithm.grouping=trajectory", "algorithm.k=4"
        )
        iteration = asyncio.create_task(router._iteration(0, evaluate=False, train=True))
        for _ in range(20):  # (a dispatch goes on over the loop's turns when a slice's time is up)
            await asyncio.sleep(0)
        runs = router.io.of(RunEpisode)
        assert len(runs) == 12  # 3 problems x 4 episodes
        rank_of: dict[str, set[bytes]] = {}
        # Episodes finish interleaved across problems, with sizes that would send every second one of a
        # problem to the other rank if each episode went to the lighter rank on its own.
        for (worker, run), n in zip(sorted(runs, key=lambda wr: wr[1].episode_id[-1]), [5, 1, 3] * 4, strict=True):
            _groups(router, run, "vertical", n)
            _done(router, worker, run)
            sent = [w for w, m in router.io.sent if isinstance(m, Groups) and m.episode_id == run.episode_id]
            rank_of.setdefault(run.problem_id, set()).update(sent)
        assert all(len(ranks) == 1 for ranks in rank_of.values()), rank_of
        assert set().union(*rank_of.values()) == {b"trainer/vertical", b"trainer/vertical/1"}  # both get work
        iteration.cancel()

    asyncio.run(scenario())


def test_a_trainers_update_reaches_every_live_replica_of_its_policy_once(tmp_path):
    """The trainer's UpdateWeights goes out as one fan-out (`RouterSocket.fan_out`, a slice at a time) to each live
    replica of its policy: not to a replica that was lost, not to another policy's."""
    router = _router(tmp_path, "policies.horizontal.replicas=2")
    second = b"inference/horizontal/1"
    router._on_hello(second, Hello("inference", second.decode(), "horizontal", 1, PROTOCOL_VERSION, 1))
    router._handle(TRAINERS[1], UpdateWeights("horizontal", 1, 0))
    updates = router.io.of(UpdateWeights)
    assert sorted(who for who, _ in updates) == [b"inference/horizontal/0", second]
    assert all(msg == UpdateWeights("horizontal", 1, 0) for _, msg in updates)
    router.io.sent.clear()
    router._peer_died(second, router.peers[second])
    router._handle(TRAINERS[1], UpdateWeights("horizontal", 2, 0))
    assert [who for who, _ in router.io.of(UpdateWeights)] == [b"inference/horizontal/0"]
