"""Lost processes, in-process: the launcher's restart budget, the router's fault record, and what the router
does when a lost env worker's replacement says Hello (its episodes run again as new attempts, whatever the
old attempts still send is dropped, the restart and the recovery are in the next row)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.launch.launcher import Restarts
from mas_async.launch.restarts import RestartBudget
from mas_async.metrics import Keys
from mas_async.router.episodes import EpisodeTask
from mas_async.router.faults import RUN_RESTART_ENV, FaultLog
from mas_async.router.hub import Router
from mas_async.router.lost_peers import LostPeers, record_lost_peer
from mas_async.wire.messages import PROTOCOL_VERSION, EpisodeDone, Hello, RunEpisode, Trained, decode
from tests.support.paths import ROOT

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)


def test_the_budget_allows_max_restarts_per_role_within_the_window():
    now = [0.0]
    budget = RestartBudget(2, window_s=60, clock=lambda: now[0])
    assert budget.take("env_worker") and budget.take("env_worker")
    assert not budget.take("env_worker")  # a third within the window
    assert budget.take("trainer")  # roles have budgets of their own
    now[0] = 61.0
    assert budget.take("env_worker") and budget.used("env_worker") == 1  # the old ones left the window
    assert not RestartBudget(0, 60).take("env_worker")


def test_the_fault_log_counts_per_row_and_times_recovery_to_the_first_result():
    faults = FaultLog()
    faults.restarted("env_worker", time.time() - 2.0, b"env_worker/1")
    faults.reissued(3)
    assert faults.result_from(b"env_worker/0") is None  # another worker: not the replacement
    recovered = faults.result_from(b"env_worker/1")
    assert recovered is not None and 2.0 <= recovered < 10
    row = faults.take()
    assert row[Keys.restarts("env_worker")] == 1 and row[Keys.restarts("trainer")] == 0
    assert row[Keys.REISSUED_EPISODES] == 3 and row[Keys.RECOVERY_S] == recovered
    assert faults.take()[Keys.restarts("env_worker")] == 0  # counted once, in one row
    faults.restarted("trainer", time.time() - 1.0)  # a whole run restarted: any first result ends it
    assert faults.result_from(b"env_worker/0") is not None


def test_faults_of_rows_run_again_are_carried_into_the_next_row():
    faults = FaultLog()
    faults.carry([{Keys.restarts("env_worker"): 2, Keys.REISSUED_EPISODES: 3}, {Keys.restarts("inference"): 1}])
    faults.restarted("inference", time.time())
    row = faults.take()
    assert row[Keys.restarts("env_worker")] == 2 and row[Keys.restarts("inference")] == 2
    assert row[Keys.REISSUED_EPISODES] == 3


def _router(tmp_path, *overrides):
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["rollout.batch_size=4", *overrides])
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, {"vertical": "", "horizontal": ""})
    return Router(config, deployment, tmp_path)


class _Sent:
    def __init__(self) -> None:
        self.frames: list[list] = []

    def forget(self, identity: bytes) -> int:
        return 0  # every message left at once: nothing waits

    def send(self, frames: list) -> None:
        self.frames.append(frames)

    def episodes_to(self, worker: bytes) -> list[RunEpisode]:
        msgs = [decode(frames[1:]) for frames in self.frames if frames[0] == worker]
        return [m for m in msgs if isinstance(m, RunEpisode)]


def _hello(router: Router, name: str, pid: int, died_at: float = 0.0) -> None:
    router._on_hello(name.encode(), Hello("env_worker", name, "", 2, PROTOCOL_VERSION, pid, died_at))


def test_a_replaced_env_worker_s_episodes_run_again_as_new_attempts(tmp_path):
    router = _router(tmp_path, "cluster.env_workers=2")
    router.io = _Sent()
    a, b = b"env_worker/0", b"env_worker/1"
    _hello(router, "env_worker/0", 100)
    _hello(router, "env_worker/1", 101)
    book = router._open_book(0, train=True, evaluate=False)  # 4 episodes, 2 per worker
    first, others = router.io.episodes_to(a), router.io.episodes_to(b)
    assert len(first) == 2 and all(m.attempt == 0 for m in first)
    router.io.frames.clear()

    died = time.time() - 1.0
    _hello(router, "env_worker/0", 200, died_at=died)  # the launcher restarted worker 0
    router._on_restarted("env_worker/0", 100, died)  # its record, read after the replacement's Hello: counted once
    again = router.io.episodes_to(a)  # the replacement has room: the two episodes run again there
    assert sorted(m.episode_id for m in again) == sorted(m.episode_id for m in first)
    assert all(m.attempt == 1 for m in again)
    assert router.peers[a].pid == 200 and router.peers[a].outstanding == 2

    late = EpisodeDone(first[0].episode_id, 0, "train", 0, "", {"success": 1.0}, {})
    router._on_episode_done(late)  # the lost attempt's result: dropped, not counted
    assert book.late == 1 and book.stats["train"].episodes == 0
    for msg in again:
        router._on_episode_done(EpisodeDone(msg.episode_id, 0, "train", 1, "", {"success": 1.0}, {}))
    for msg in others:
        router._on_episode_done(EpisodeDone(msg.episode_id, 0, "train", 0, "", {"success": 1.0}, {}))
    assert book.done.is_set() and book.stats["train"].episodes == 4 and book.dropped["train"] == 0
    row = router.faults.take()
    assert row[Keys.restarts("env_worker")] == 1 and row[Keys.REISSUED_EPISODES] == 2
    assert 1.0 <= row[Keys.RECOVERY_S] < 30


def test_a_repeated_hello_of_the_same_process_is_no_restart(tmp_path):
    router = _router(tmp_path, "cluster.env_workers=2")
    router.io = _Sent()
    _hello(router, "env_worker/0", 100)
    _hello(router, "env_worker/0", 100)
    assert router.faults.take()[Keys.restarts("env_worker")] == 0


def test_a_silent_env_worker_is_told_to_exit_so_that_it_is_restarted(tmp_path):
    router = _router(tmp_path, "cluster.env_workers=2")
    router.io = _Sent()
    _hello(router, "env_worker/0", 100)
    _hello(router, "env_worker/1", 101)
    router._open_book(0, train=True, evaluate=False)
    router._peer_died(b"env_worker/0", router.peers[b"env_worker/0"])
    told = [decode(f[1:]) for f in router.io.frames if f[0] == b"env_worker/0"][-1]
    assert type(told).__name__ == "Shutdown" and told.failed and "silent" in told.reason
    assert router.faults.take()[Keys.REISSUED_EPISODES] == 2
    # in case it is hung and never reads the Shutdown, the launcher is told to kill it
    assert [(r["name"], r["pid"]) for r in LostPeers(tmp_path).new()] == []  # a new reader: later records only
    assert [(r["name"], r["pid"]) for r in _all_records(tmp_path)] == [("env_worker/0", 100)]


def _all_records(run_dir):
    reader = LostPeers(run_dir)
    reader.offset = 0
    return reader.new()


def test_a_restarted_run_reports_the_lost_role(tmp_path, monkeypatch):
    monkeypatch.setenv(RUN_RESTART_ENV, f'{{"role": "trainer", "died_at": {time.time() - 5.0}}}')
    router = _router(tmp_path)
    assert router.faults.restarts["trainer"] == 1
    assert router.faults.result_from(b"env_worker/0") == pytest.approx(5.0, abs=2.0)


def test_a_step_that_never_completes_is_a_named_error_saying_who_did_not_report(tmp_path):
    import asyncio

    from mas_async.router.clock import StepTimeout
    from mas_async.wire.messages import Trained, WeightsLoaded
    from tests.unit.framework.test_router_barrier import _done
    from tests.unit.framework.test_router_barrier import _router as barrier_router

    async def scenario() -> None:
        router = barrier_router(tmp_path, "trainer.step_timeout_s=0.3")
        iteration = asyncio.create_task(router._iteration(0, evaluate=False, train=True))
        await asyncio.sleep(0)
        for worker, run in router.io.of(RunEpisode):
            _done(router, worker, run)
        await asyncio.sleep(0)
        router._handle(b"trainer/vertical", Trained("vertical", 1, "", {}))
        router._handle(b"inference/vertical/0", WeightsLoaded("vertical", 1, "inference/vertical/0", ""))
        with pytest.raises(StepTimeout, match=r"version 0 .* trainer rank 0 of 'horizontal', inference/horizontal/0"):
            await asyncio.wait_for(iteration, 10)

    asyncio.run(scenario())


class _Dead:
    """A child of the launcher that has exited with `code` (what `supervise` looks at)."""

    def __init__(self, name: str, code: int | None) -> None:
        from mas_async.launch.engines.base import Node

        self.name, self.code, self.node, self.pid = name, code, Node("local", "127.0.0.1"), 1
        self.log_path = Path(f"{name.replace('/', '-')}.log")

    def tail(self) -> str:
        return f"the last lines of {self.name}"

    def poll(self) -> int | None:
        return self.code

    def wait(self, timeout: float) -> int | None:
        return self.code

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def where(self) -> str:
        return "pid 1 on local"


class _Quiet:
    def update(self) -> None: ...

    def finish(self) -> None: ...

    def note(self, text: str) -> None: ...


def _restarts() -> Restarts:
    config = load_config(ROOT / "configs" / "plan_path_tiny.yaml")
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, {"vertical": "", "horizontal": ""})
    return Restarts(engine=None, launches={}, budget=RestartBudget(3, 600), whole_run=True, config=config,  # type: ignore[arg-type]
                    deployment=deployment)  # fmt: skip


def test_the_process_killed_by_a_signal_is_the_cause_not_those_that_failed_on_its_loss(tmp_path):
    """A trainer SIGKILLed mid-step: a replica and the router fail on its loss, all found dead at once; the
    restart is the trainer's."""
    from mas_async.launch.launcher import RunLost, supervise

    children = [_Dead("router", 1), _Dead("inference/vertical/0", 1), _Dead("trainer/vertical", -9)]
    restarts = _restarts()
    with pytest.raises(RunLost) as lost:
        supervise(children, tmp_path, _Quiet(), restarts)  # type: ignore[arg-type]
    assert lost.value.role == "trainer" and restarts.budget.used("router") == 0


class _Hung(_Dead):
    """A child that runs on (hung) until it is killed."""

    def __init__(self, name: str) -> None:
        super().__init__(name, None)
        self.killed = False

    def kill(self) -> None:
        self.killed, self.code = True, -9


class _RouterThatNames(_Dead):
    """A router that declares `lost` silent (the record for the launcher), then exits with status 1."""

    def __init__(self, run_dir, lost: str) -> None:
        super().__init__("router", None)
        self.run_dir, self.lost = run_dir, lost

    def poll(self) -> int | None:
        if self.code is None:
            record_lost_peer(self.run_dir, self.lost, 4242, "silent for over 30s")
            self.code = 1
            return None
        return self.code


def test_a_hung_process_the_router_declared_lost_is_killed_and_is_the_cause(tmp_path):
    """A hung trainer never exits by itself: the router names it and stops; the launcher kills it, and the
    whole-run restart is the trainer's, not the router's."""
    from mas_async.launch.launcher import RunLost, supervise

    trainer, replica = _Hung("trainer/vertical"), _Hung("inference/vertical/0")
    children = [_RouterThatNames(tmp_path, "trainer/vertical"), trainer, replica]
    restarts = _restarts()
    with pytest.raises(RunLost) as lost:
        supervise(children, tmp_path, _Quiet(), restarts)  # type: ignore[arg-type]
    assert trainer.killed and lost.value.role == "trainer" and restarts.budget.used("router") == 0


def test_a_record_older_than_the_process_it_names_is_about_its_predecessor(tmp_path):
    from mas_async.launch.launcher import _kill_lost

    worker = _Hung("env_worker/0")
    reader = LostPeers(tmp_path)
    record_lost_peer(tmp_path, "env_worker/0", 100, "silent")
    assert _kill_lost([worker], reader, {"env_worker/0": time.time() + 60}, _Quiet()) == []  # type: ignore[list-item]
    assert not worker.killed
    record_lost_peer(tmp_path, "env_worker/0", 101, "silent")
    assert _kill_lost([worker], reader, {"env_worker/0": 0.0}, _Quiet()) == [worker]  # type: ignore[list-item]
    assert worker.killed


def _request(router: Router, request_id: int, policy: str = "vertical") -> None:
    """An env worker's Generate, as the router's hot path sees it."""
    import numpy as np

    from mas_async.wire.messages import Generate, encode, peek

    msg = Generate(request_id, policy, "env_worker/0", time.time() + 60, np.arange(3, dtype=np.int32), 1, 4, 1.0,
                   1.0, False, [])  # fmt: skip
    frames = encode(msg)
    router._route_generate(b"env_worker/0", peek(frames)[1], frames)


def _result(router: Router, replica: bytes, request_id: int) -> None:
    from mas_async.wire.messages import GenerateResult, encode, peek

    frames = encode(GenerateResult(request_id, "env_worker/0", "", []))
    router._route_result(replica, peek(frames)[1], frames)


def _to(sent: _Sent, identity: bytes) -> list:
    """The Generate and GenerateResult messages sent to `identity`."""
    msgs = [decode(frames[1:]) for frames in sent.frames if frames[0] == identity]
    return [m for m in msgs if type(m).__name__ in ("Generate", "GenerateResult")]


def _replica_run(tmp_path, replicas: int) -> Router:
    router = _router(tmp_path, f"policies.vertical.replicas={replicas}")
    router.io = _Sent()
    router._on_hello(b"trainer/vertical", Hello("trainer", "trainer/vertical", "vertical", 0, PROTOCOL_VERSION, 5))
    for r in range(replicas):
        name = f"inference/vertical/{r}"
        router._on_hello(name.encode(), Hello("inference", name, "vertical", 8, PROTOCOL_VERSION, 10 + r))
    router.io.frames.clear()
    return router


def _orders(sent: _Sent) -> dict[bytes, list[tuple[int, list[int], list[int]]]]:
    """(generation, members, fresh) of every ReformWeightGroup sent, by recipient."""
    from mas_async.wire.messages import ReformWeightGroup

    orders: dict[bytes, list[tuple[int, list[int], list[int]]]] = {}
    for frames in sent.frames:
        msg = decode(frames[1:])
        if isinstance(msg, ReformWeightGroup):
            orders.setdefault(frames[0], []).append((msg.generation, msg.members, msg.fresh))
    return orders


def test_a_lost_replica_leaves_the_group_at_once_and_its_replacement_catches_up_before_it_serves(tmp_path):
    """The launcher's word that replica 0 died: its requests go to replica 1, the weight group's next
    generation is replica 1 alone (the trainer and replica 1 are told; a step waits for replica 1 only). When
    the replacement is ready (Hello), generation 3 holds both, replica 0 catching up first (in generation 2);
    it gets requests once it reported the version the others hold, and the clock waits for it again."""
    from mas_async.wire.messages import WeightsLoaded

    router = _replica_run(tmp_path, replicas=2)
    a, b, trainer = b"inference/vertical/0", b"inference/vertical/1", b"trainer/vertical"
    for request_id in range(4):  # the least-loaded replica each time: two each
        _request(router, request_id)
    on_a = [m.request_id for m in _to(router.io, a)]
    assert len(on_a) == 2 and len(_to(router.io, b)) == 2
    router.io.frames.clear()

    died = time.time() - 1.0
    router._on_restarted("inference/vertical/0", 10, died)  # the launcher's word, long before its replacement loads
    assert sorted(m.request_id for m in _to(router.io, b)) == sorted(on_a)
    assert _orders(router.io) == {trainer: [(1, [1], [])], b: [(1, [1], [])]}
    router.io.frames.clear()
    router.clock.begin_step()  # a step now waits for the live replica only
    router._handle(trainer, Trained("vertical", 1, "", {}))
    router._handle(b"trainer/horizontal", Trained("horizontal", 1, "", {}))
    router._handle(b, WeightsLoaded("vertical", 1, "inference/vertical/1", ""))
    router.clock.loaded("horizontal", "inference/horizontal/0", 1)
    assert router.clock.step_complete()
    router.clock.advance()

    hello = Hello("inference", "inference/vertical/0", "vertical", 8, PROTOCOL_VERSION, 99, died)
    router._on_hello(a, hello)  # the replacement is ready (the same restart: counted once)
    assert _orders(router.io) == {trainer: [(3, [0, 1], [0])], a: [(3, [0, 1], [0])], b: [(3, [0, 1], [0])]}
    router.io.frames.clear()
    _result(router, a, on_a[0])  # a late result of the lost replica: not its request any more
    assert router.refused == 1 and not _to(router.io, b"env_worker/0")
    _request(router, 10)  # the replacement has not caught up: it gets no request
    assert [m.request_id for m in _to(router.io, b)] == [10] and not _to(router.io, a)
    router._handle(a, WeightsLoaded("vertical", 1, "inference/vertical/0", ""))  # v1, sent in generation 2
    _request(router, 11)
    assert [m.request_id for m in _to(router.io, a)] == [11]  # it serves now (the least loaded)
    assert ("vertical", "inference/vertical/0") in router.clock.loads
    _result(router, a, 11)
    row = router.faults.take()
    assert row[Keys.restarts("inference")] == 1 and row[Keys.REISSUED_REQUESTS] == 2
    assert 1.0 <= row[Keys.RECOVERY_S] < 30  # from the death to the replacement's first result


def test_a_replica_that_dies_before_its_hello_is_replaced_and_the_run_starts_without_waiting_for_it(tmp_path):
    """Replica 0 dies while its model loads (it never said Hello): the launcher's record takes it out of the
    first generation (the trainer and replica 1, waiting in it, are told) and the run starts without it;
    its replacement's Hello is a restart (counted), and it joins, catching up first."""
    router = _router(tmp_path, "policies.vertical.replicas=2")
    router.io = _Sent()
    peers = ["trainer/vertical", "trainer/horizontal", "inference/vertical/1", "inference/horizontal/0",
             "env_worker/0", "env_worker/1"]  # fmt: skip
    for i, name in enumerate(peers):
        role = name.split("/")[0]
        policy = name.split("/")[1] if role != "env_worker" else ""
        router._on_hello(name.encode(), Hello(role, name, policy, 4, PROTOCOL_VERSION, 10 + i))
    assert not router.all_joined.is_set()
    died = time.time() - 2.0
    router._on_restarted("inference/vertical/0", 77, died)
    assert router.all_joined.is_set()
    orders = _orders(router.io)
    assert orders[b"trainer/vertical"] == orders[b"inference/vertical/1"] == [(1, [1], [])]
    assert ("vertical", "inference/vertical/0") not in router.clock.loads
    router.io.frames.clear()
    hello = Hello("inference", "inference/vertical/0", "vertical", 8, PROTOCOL_VERSION, 99, died)
    router._on_hello(b"inference/vertical/0", hello)
    assert _orders(router.io)[b"inference/vertical/0"] == [(3, [0, 1], [0])]
    assert router.faults.take()[Keys.restarts("inference")] == 1


def test_a_lone_replica_s_requests_wait_at_the_router_for_its_replacement(tmp_path):
    from mas_async.wire.messages import WeightsLoaded

    router = _replica_run(tmp_path, replicas=1)
    a = b"inference/vertical/0"
    _request(router, 1)
    router._peer_died(a, router.peers[a])  # silent: declared dead (it is not the run's end)
    _request(router, 2)
    hello = Hello("inference", "inference/vertical/0", "vertical", 8, PROTOCOL_VERSION, 99, time.time())
    router.io.frames.clear()
    router._on_hello(a, hello)
    assert not _to(router.io, a)  # held, not lost
    assert not _to(router.io, b"env_worker/0")  # and no error sent back
    router._handle(a, WeightsLoaded("vertical", 0, "inference/vertical/0", ""))
    assert sorted(m.request_id for m in _to(router.io, a)) == [1, 2]
    assert router.faults.take()[Keys.REISSUED_REQUESTS] == 1


def test_each_replacement_joins_when_it_is_ready_without_waiting_for_the_others(tmp_path):
    """Both replicas lost: the group has no replica left (generation 2), requests wait at the router. Each
    replacement joins as soon as it says Hello; one that has not caught up yet when the next order comes
    catches up in that one too."""
    router = _replica_run(tmp_path, replicas=2)
    a, b, trainer = b"inference/vertical/0", b"inference/vertical/1", b"trainer/vertical"
    router._peer_died(a, router.peers[a])
    router._peer_died(b, router.peers[b])
    assert _orders(router.io)[trainer] == [(1, [1], []), (2, [], [])]
    router.io.frames.clear()
    router._on_hello(a, Hello("inference", "inference/vertical/0", "vertical", 8, PROTOCOL_VERSION, 98, time.time()))
    assert _orders(router.io)[trainer] == [(4, [0], [0])]  # b is still down: a does not wait for it
    router._on_hello(b, Hello("inference", "inference/vertical/1", "vertical", 8, PROTOCOL_VERSION, 99, time.time()))
    assert _orders(router.io)[trainer][-1] == (6, [0, 1], [0, 1])  # a had not reported its catch-up yet


# -- whole-run restarts end -------------------------------------------------------------------------


def _launch_losing_the_trainer(tmp_path, monkeypatch, checkpoints: list[int], *overrides: str) -> tuple[int, int]:
    """`launch()` of a run whose every start loses its trainer (the same fault, at the same point, each time);
    the run's last complete checkpoint after start i is checkpoints[i]. Returns (exit status, starts); at most
    len(checkpoints) starts, so a launcher that never stops fails the test instead of hanging it."""
    from mas_async.launch import launcher

    config = load_config(ROOT / "configs" / "plan_path_tiny.yaml", [f"run.output_dir={tmp_path / 'run'}", *overrides])
    starts = []

    def lose_the_trainer(*args, **kwargs) -> int:
        if len(starts) == len(checkpoints):
            raise AssertionError(f"the run was started {len(starts)} times and is being started again")
        starts.append(args[2])  # the version it starts from
        raise launcher.RunLost(_Dead("trainer/vertical", -9), -9, time.time())  # type: ignore[arg-type]

    monkeypatch.setattr(launcher, "_run", lose_the_trainer)
    monkeypatch.setattr(launcher, "open_engine", lambda config: type("E", (), {"close": lambda self: None})())
    monkeypatch.setattr(launcher, "latest_complete", lambda run_dir, policies: checkpoints[len(starts) - 1])
    return launcher.launch(config), len(starts)


def test_a_fault_that_recurs_before_a_new_checkpoint_stops_the_run(tmp_path, monkeypatch, capsys):
    """Restarted from v4, the run loses its trainer again before it writes v6: a second restart would repeat
    the same fault (the data and seeds are the same), so the run stops, says why, and names the log."""
    code, starts = _launch_losing_the_trainer(tmp_path, monkeypatch, [4, 4, 4, 4])
    assert (code, starts) == (1, 2)
    err = capsys.readouterr().err
    assert "restarting the run from its checkpoint of version 4" in err
    assert "the run is not restarted: the run was restarted from its checkpoint of version 4 and lost a process" in err
    assert "Last lines of trainer-vertical.log:\n\nthe last lines of trainer/vertical" in err
    records = (tmp_path / "run" / "restarts.jsonl").read_text().splitlines()
    assert len(records) == 1 and '"from_version": 4' in records[0]


def test_whole_run_restarts_have_a_total_even_with_progress(tmp_path, monkeypatch, capsys):
    """Each start makes progress (a newer checkpoint), so the progress rule allows every restart; the total
    (`cluster.max_run_restarts`) still ends them."""
    code, starts = _launch_losing_the_trainer(
        tmp_path, monkeypatch, [2, 4, 6, 8, 10, 12], "cluster.max_run_restarts=3", "cluster.max_restarts=100"
    )
    assert (code, starts) == (1, 4)  # the first start and 3 restarts
    assert "the run has been restarted 3 times, cluster.max_run_restarts=3" in capsys.readouterr().err


def test_the_restart_record_outlives_the_launcher(tmp_path):
    """A launcher that resumes the run (a requeued job) reads the restarts of the launchers before it."""
    from mas_async.launch.restarts import RunRestarts

    first = RunRestarts(tmp_path, 5)
    assert first.refusal(0) is None
    first.record("trainer", 1.0, 0)
    later = RunRestarts(tmp_path, 5)
    assert later.records == first.records and "before it wrote a newer one" in (later.refusal(0) or "")
    assert later.refusal(2) is None


# -- poisoned episodes ---------------------------------------------------------------------------------


def test_an_episode_that_kills_its_workers_is_dropped_after_its_attempts_and_its_problem_never_runs_again(tmp_path):
    """One problem kills whichever worker runs it. Attempts 0 and 1 die with a neighbour (both run again);
    attempt 2, the last of rollout.max_attempts=3, runs alone, on the replacement that just joined, and so
    does the neighbour's, on the other worker once that one is drained (reserved: it takes no new episode
    until idle). When the last attempt kills its worker too, only the poisoned episode is dropped and
    counted, by its problem id; the iteration ends with the other three; the problem is not dispatched
    again when it comes round."""
    router = _router(tmp_path, "cluster.env_workers=2", "rollout.batch_size=4", "rollout.episodes_per_worker=2")
    router.io = _Sent()
    pids = {b"env_worker/0": 100, b"env_worker/1": 101}
    for worker, pid in pids.items():
        _hello(router, worker.decode(), pid)
    book = router._open_book(0, train=True, evaluate=False)
    poison = router.io.episodes_to(b"env_worker/0")[0]

    def running(episode_id: str) -> EpisodeTask:
        return book.in_flight[episode_id]

    def kill(worker: bytes) -> None:
        died = time.time()
        router._on_restarted(worker.decode(), pids[worker], died)  # the launcher's word, then the replacement's Hello
        pids[worker] += 1000
        _hello(router, worker.decode(), pids[worker], died_at=died)

    def finish(task: EpisodeTask) -> None:
        router._on_episode_done(EpisodeDone(task.msg.episode_id, 0, "train", task.msg.attempt, "", {"success": 1}, {}))

    kill(running(poison.episode_id).worker)  # type: ignore[arg-type]
    assert running(poison.episode_id).msg.attempt == 1 and not running(poison.episode_id).alone
    neighbour = next(
        t.msg.episode_id
        for t in book.in_flight.values()
        if t.worker == running(poison.episode_id).worker and t.msg.episode_id != poison.episode_id
    )
    kill(running(poison.episode_id).worker)  # type: ignore[arg-type]
    last = running(poison.episode_id)
    assert last.alone and last.msg.attempt == 2 and router.peers[last.worker].exclusive  # type: ignore[index]
    assert router.peers[last.worker].outstanding == 1  # type: ignore[index]
    assert [t.msg.episode_id for t in book.queued] == [neighbour] and book.queued[0].alone
    other = next(w for w in pids if w != last.worker)
    assert router.peers[other].reserved and router.peers[other].outstanding == 2  # drained before it runs it
    for task in [t for t in book.in_flight.values() if t.worker == other]:
        finish(task)
    assert running(neighbour).worker == other and router.peers[other].exclusive
    kill(last.worker)  # type: ignore[arg-type]
    assert book.poisoned == [poison.problem_id] and book.dropped["train"] == 1
    assert poison.episode_id not in book.in_flight and not book.queued
    finish(running(neighbour))
    assert book.done.is_set() and book.stats["train"].episodes == 3 and not router.peers[other].exclusive
    assert router.faults.take()[Keys.restarts("env_worker")] == 3
    # The problem comes round again: counted as poisoned, never dispatched.
    router.io.frames.clear()
    router._order = [int(poison.problem_id.removeprefix("train"))] * len(router._order)
    later = router._open_book(1, train=True, evaluate=False)
    assert later.poisoned == [poison.problem_id] * 4 and later.done.is_set()
    assert not [f for f in router.io.frames if type(decode(f[1:])).__name__ == "RunEpisode"]
