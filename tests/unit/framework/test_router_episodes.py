"""The router's episode plan per iteration: tree sampling (one episode per problem), parallel sampling
(K independent episodes per problem, same problem id), eval.k episodes per test problem; the data
order depends only on the seed and the iteration (what a resumed run relies on)."""

from __future__ import annotations

import time
from collections import Counter

from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.router.hub import Router
from tests.support.paths import ROOT


def _router(tmp_path, *overrides):
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["env.train_size=64", "env.test_size=8", *overrides])
    deployment = Deployment("tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, {"vertical": "", "horizontal": ""})
    tmp_path.mkdir(parents=True, exist_ok=True)
    return Router(config, deployment, tmp_path)


def test_tree_sampling_runs_one_episode_per_problem(tmp_path):
    tasks = list(_router(tmp_path, "rollout.batch_size=5")._episodes(3, 3, train=True, evaluate=False))
    assert len(tasks) == 5 and len({t.msg.problem_id for t in tasks}) == 5
    assert all(t.msg.mode == "train" and t.msg.version == 3 and t.msg.iteration == 3 for t in tasks)


def test_parallel_sampling_runs_k_episodes_per_problem(tmp_path):
    router = _router(tmp_path, "rollout.batch_size=5", "algorithm.sampling=parallel", "algorithm.grouping=agent",
                     "algorithm.k=4")  # fmt: skip
    tasks = list(router._episodes(0, 0, train=True, evaluate=False))
    assert len(tasks) == 20
    assert set(Counter(t.msg.problem_id for t in tasks).values()) == {4}
    assert len({t.msg.episode_id for t in tasks}) == 20 and len({t.msg.seed for t in tasks}) == 20
    assert {t.msg.problem_episodes for t in tasks} == {4}  # what a streamed step waits for per problem


def test_episodes_say_how_many_episodes_of_the_iteration_run_their_problem(tmp_path):
    """With more problems per batch than the dataset holds a problem is drawn twice: its advantages pool
    both draws' episodes, so each carries the count (a streamed step waits for them all); a re-dispatched
    attempt keeps it."""
    router = _router(tmp_path, "env.train_size=3", "rollout.batch_size=5")
    tasks = list(router._episodes(0, 0, train=True, evaluate=False))
    drawn = Counter(t.msg.problem_id for t in tasks)
    assert sorted(drawn.values()) == [1, 2, 2]
    assert all(t.msg.problem_episodes == drawn[t.msg.problem_id] for t in tasks)
    assert {t.msg.problem_episodes for t in router._episodes(0, 0, train=False, evaluate=True)} == {1}
    from mas_async.router.episodes import EpisodeBook

    book = EpisodeBook(0, 0, tasks)
    twice = next(iter(book.next_planned, None))  # (train0-0: the first problem, drawn twice)
    assert twice.msg.problem_episodes == 2
    twice.worker = b"env_worker/0"
    book.in_flight[twice.msg.episode_id] = twice
    assert book.requeue(b"env_worker/0", max_attempts=3) == (1, [])
    assert book.queued[-1].msg.attempt == 1 and book.queued[-1].msg.problem_episodes == 2


def test_eval_k_episodes_per_test_problem(tmp_path):
    router = _router(tmp_path, "eval.size=6", "eval.k=3", "eval.greedy=false", "eval.baselines=false")
    tasks = list(router._episodes(0, 0, train=False, evaluate=True))
    assert len(tasks) == 18 and set(Counter(t.msg.problem_id for t in tasks).values()) == {3}
    test_split = _problems(router, "test")
    train_split = _problems(router, "train")
    assert [t.msg.problem for t in tasks[::3]] == test_split[:6]  # the test split's first eval.size problems
    assert not any(t.msg.problem in train_split for t in tasks)


def _problems(router, split):
    from mas_async.api import ENVS, resolve

    env_cls = resolve(router.cfg.env.name, ENVS, "env")
    return env_cls.problems(split, getattr(router.cfg.env, f"{split}_size"), **router.cfg.env.options)


def test_data_order_depends_on_seed_and_iteration_only(tmp_path):
    a = [t.msg.problem_id for t in _router(tmp_path / "a")._episodes(7, 7, train=True, evaluate=False)]
    b = [t.msg.problem_id for t in _router(tmp_path / "b")._episodes(7, 7, train=True, evaluate=False)]
    c = [t.msg.problem_id for t in _router(tmp_path / "c", "run.seed=1")._episodes(7, 7, train=True, evaluate=False)]
    assert a == b and a != c


def _header(cls, *values):
    """A header view as `peek` makes it (missing trailing fields are filled with placeholders)."""
    from mas_async.wire.messages import HEADERS

    view = HEADERS[cls.KIND]
    return view(*values, *([None] * (len(view._fields) - len(values))))


class _Sent:
    """Stands in for the router's socket: records what it would send (taking `send_s` seconds per message)."""

    def __init__(self, send_s: float = 0.0) -> None:
        self.frames: list[list] = []
        self.send_s = send_s

    def forget(self, identity: bytes) -> int:
        return 0  # every message left at once: nothing waits

    def send(self, frames: list) -> None:
        if self.send_s:
            until = time.perf_counter() + self.send_s
            while time.perf_counter() < until:
                pass
        self.frames.append(frames)


def test_generate_goes_to_the_replica_with_fewest_outstanding_and_results_go_back(tmp_path):
    from mas_async.wire.messages import PROTOCOL_VERSION, Generate, GenerateResult, Hello

    router = _router(tmp_path, "policies.horizontal.replicas=2")
    router.io = _Sent()
    a, b = b"inference/horizontal/0", b"inference/horizontal/1"
    router._on_hello(a, Hello("inference", a.decode(), "horizontal", 8, PROTOCOL_VERSION, 1))
    router._on_hello(b, Hello("inference", b.decode(), "horizontal", 8, PROTOCOL_VERSION, 2))
    router._on_hello(a, Hello("inference", a.decode(), "horizontal", 8, PROTOCOL_VERSION, 1))  # repeated
    assert router.table.routed_replicas("horizontal") == [b, a]
    router.io.frames.clear()
    worker = b"env_worker/0"
    for request_id in range(4):
        router._route_generate(worker, _header(Generate, request_id, "horizontal"), [b"k", b"h", b"p"])
    servers = [frames[0] for frames in router.io.frames]
    assert sorted(servers) == [a, a, b, b]  # balanced by outstanding requests
    assert router.peers[a].outstanding == router.peers[b].outstanding == 2
    router._route_result(servers[0], _header(GenerateResult, 0, worker.decode(), ""), [b"k", b"h", b"p"])
    assert router.io.frames[-1][0] == worker and router.peers[servers[0]].outstanding == 1
    router._route_generate(
        worker, _header(Generate, 9, "vertical", "env_worker/0", 0.0), [b"k", b"h", b"p"]
    )  # no replica of that policy yet
    assert router.io.frames[-1][0] == worker  # answered at once with an error, nothing forwarded


def _dispatching_router(tmp_path, send_s: float = 0.0):
    """A router of 600 training episodes per iteration and 2 env workers of 290 episodes each, whose socket
    records what it would send (taking `send_s` seconds per message)."""
    from mas_async.wire.messages import PROTOCOL_VERSION, Hello

    router = _router(tmp_path, "rollout.batch_size=600", "cluster.env_workers=2")
    router.io = _Sent(send_s)
    for name in ("env_worker/0", "env_worker/1"):
        router._on_hello(name.encode(), Hello("env_worker", name, "", 290, PROTOCOL_VERSION, 1))
    router.io.frames.clear()
    return router


def _open_and_turn(router, turns: int) -> tuple[list[int], list[str], object]:
    """Open iteration 0's book and let the loop turn `turns` times: the RunEpisodes sent after the open and
    after each turn (counts), every episode sent in order, and the book."""
    import asyncio

    from mas_async.wire.messages import RunEpisode, decode

    async def scenario():
        book = router._open_book(0, train=True, evaluate=False)
        counts = [len(router.io.frames)]
        assert not book.planned and len(book.queued) <= 1  # the plan is taken as it is dispatched, not at once
        for _ in range(turns):
            await asyncio.sleep(0)
            counts.append(len(router.io.frames))
        return counts, book

    counts, book = asyncio.run(scenario())  # (in a running loop: with none, a dispatch sends all it may)
    sent = [decode(frames[1:]) for frames in router.io.frames]
    assert all(isinstance(m, RunEpisode) for m in sent)
    return counts, [m.episode_id for m in sent], book


def test_a_large_iteration_goes_out_a_slice_per_turn_of_the_loop_in_order_each_once(tmp_path):
    """An iteration of 600 episodes opening at once: at most `DISPATCH_SLICE` RunEpisodes go at once and the
    rest on the loop's next turns (`_dispatch_rest`), so no message waits ~100 ms for the router; every episode
    goes once, in the plan's order, and none beyond the workers' capacity."""
    from mas_async.router.hub import DISPATCH_SLICE

    router = _dispatching_router(tmp_path)
    counts, episodes, book = _open_and_turn(router, 3 * 580)
    assert DISPATCH_SLICE < 290 and 1 <= counts[0] <= DISPATCH_SLICE
    assert max(b - a for a, b in zip(counts, counts[1:], strict=False)) <= DISPATCH_SLICE  # other tasks ran between
    assert episodes == [f"train0-{i}" for i in range(580)]  # the capacity of both: in order, each once
    assert len(book.queued) + len(list(iter(book.next_planned, None))) == 20  # the rest wait for room, as before
    assert book.stats["train"].episodes == 0 and not book.done.is_set()


def test_a_slice_of_the_dispatch_stops_at_its_time_bound(tmp_path):
    """Sends of 0.4 ms each (a loaded machine): a turn of the loop dispatches `DISPATCH_MIN` then stops at
    `DISPATCH_S`, not at `DISPATCH_SLICE` sends (~26 ms), and every episode still goes, in order."""
    from mas_async.router.hub import DISPATCH_MIN, DISPATCH_S, DISPATCH_SLICE

    router = _dispatching_router(tmp_path, send_s=0.0004)
    counts, episodes, _ = _open_and_turn(router, 580)
    bound = max(DISPATCH_MIN, int(DISPATCH_S / 0.0004) + 1)
    assert bound < DISPATCH_SLICE and counts[0] <= bound
    assert max(b - a for a, b in zip(counts, counts[1:], strict=False)) <= bound
    assert episodes == [f"train0-{i}" for i in range(len(episodes))] and len(episodes) > 3 * bound


def test_with_no_loop_running_a_dispatch_sends_all_it_may(tmp_path):
    """Nothing waits on a loop that does not run: a dispatch called outside one is not sliced (and schedules
    nothing)."""
    router = _dispatching_router(tmp_path)
    router._open_book(0, train=True, evaluate=False)
    assert [decode_episode(frames) for frames in router.io.frames] == [f"train0-{i}" for i in range(580)]
    assert not router._dispatch_due


def decode_episode(frames: list) -> str:
    from mas_async.wire.messages import decode

    return decode(frames[1:]).episode_id
