"""PrioritySlots: scarce slots go to the oldest iteration's episodes, then (under a streamed step) to the
episode that came first, then to the episode furthest behind (lowest turn), in arrival order among equals;
the env worker tags each episode's task with its iteration and, streaming, its place."""

from __future__ import annotations

import asyncio
from contextvars import ContextVar

import pytest

from mas_async.api import PrioritySlots, episode_iteration, episode_ordinal, episode_turn


def _grant_order(waiting: tuple[tuple[str, int, int] | tuple[str, int, int, int], ...]) -> list[str]:
    """The order in which one busy slot, once freed, is granted to waiters (name, iteration, turn[,
    ordinal]) that queued for it in the order given."""

    async def scenario() -> list[str]:
        slots = PrioritySlots(1)
        order: list[str] = []
        release = asyncio.Event()

        async def holder() -> None:
            async with slots:
                await release.wait()

        async def waiter(name: str, iteration: int, turn: int, ordinal: int = 0) -> None:
            episode_iteration.set(iteration)  # as the env worker does for each episode's task
            episode_ordinal.set(ordinal)  # (the env worker's, under a streamed step)
            episode_turn.set(turn)  # as an episode does before scoring its candidates
            async with slots:
                order.append(name)

        first = asyncio.create_task(holder())
        await asyncio.sleep(0)
        tasks = [asyncio.create_task(waiter(*w)) for w in waiting]
        await asyncio.sleep(0.01)
        assert order == []  # all wait for the one slot
        release.set()
        await asyncio.gather(first, *tasks)
        assert slots.free == 1
        return order

    return asyncio.run(scenario())


def test_a_freed_slot_goes_to_the_lowest_turn_then_in_arrival_order() -> None:
    waiting = (("ahead", 0, 3), ("behind-a", 0, 1), ("mid", 0, 2), ("behind-b", 0, 1))
    assert _grant_order(waiting) == ["behind-a", "behind-b", "mid", "ahead"]


def test_an_older_iterations_episodes_go_first_whatever_their_turn() -> None:
    """Bounded staleness: iteration 5's step waits for its last episode, so its late turn goes before
    iteration 6's first turns."""
    waiting = (("next-0", 6, 0), ("this-3", 5, 3), ("next-1", 6, 1), ("this-2", 5, 2))
    assert _grant_order(waiting) == ["this-2", "this-3", "next-0", "next-1"]


def test_streamed_the_episode_that_came_first_goes_first_whatever_its_turn() -> None:
    """A streamed step computes each problem when its episodes are in: the first episodes finish first."""
    waiting = (("third-0", 4, 0, 2), ("first-3", 4, 3, 0), ("second-1", 4, 1, 1), ("old", 3, 3, 9))
    assert _grant_order(waiting) == ["old", "first-3", "second-1", "third-0"]


RUNNING: ContextVar[str] = ContextVar("running")
"""The episode id of the test's episode task (set by the test, read by its fake generate)."""


def _ordinals_seen(tiny_model, streaming: bool, iterations: tuple[int, ...]) -> tuple[list[int], object]:
    """The `episode_ordinal` each of a worker's episodes saw (of the given iterations, dispatched in that
    order, run at once), and the worker."""
    import numpy as np

    from mas_async.config import load_config
    from mas_async.deployment import Deployment
    from mas_async.rollout.env_worker import EnvWorker
    from mas_async.wire.messages import RunEpisode
    from mas_async.wire.samples import Completion
    from tests.support.paths import ROOT

    config = load_config(
        ROOT / "configs/plan_path_tiny.yaml", ["algorithm.k=2", f"trainer.streaming={str(streaming).lower()}"]
    )
    paths = {"vertical": str(tiny_model), "horizontal": str(tiny_model)}
    worker = EnvWorker(config, Deployment("tcp://127.0.0.1:1", {}, paths), 0)
    seen: dict[str, int] = {}

    async def generate(policy: str, prompt_ids, n: int, greedy: bool) -> list[Completion]:
        seen.setdefault(RUNNING.get(), episode_ordinal.get())
        token = np.array([worker.stop_ids[policy][0]], dtype=np.int32)
        return [Completion(token, np.zeros(1, dtype=np.float32), 0, "stop") for _ in range(n)]

    worker.generate, worker.send = generate, lambda message: None
    problem = worker.env_cls.problems("train", 1, **config.env.options)[0]
    ids = [f"train{iteration}-{index}" for index, iteration in enumerate(iterations)]

    async def one(episode: str, iteration: int, index: int) -> None:
        RUNNING.set(episode)
        await worker._run_episode(RunEpisode(episode, iteration, "train", 0, "p0", problem, index, iteration))

    async def at_once() -> None:
        await asyncio.gather(*(one(e, it, i) for i, (e, it) in enumerate(zip(ids, iterations, strict=True))))

    asyncio.run(at_once())
    return [seen[episode] for episode in ids], worker


def test_the_env_worker_numbers_an_iterations_episodes_when_the_step_is_streamed(tiny_model) -> None:
    """What the sandbox's slots see during each episode: its place among its iteration's episodes on this
    worker when the step is streamed, 0 for every episode when it is not."""
    ordinals, worker = _ordinals_seen(tiny_model, True, (5, 5, 6, 5, 6))
    assert ordinals == [0, 1, 0, 2, 1]
    worker.arrival(9)
    assert sorted(worker.arrived) == [9]  # the counts of old iterations are let go
    assert _ordinals_seen(tiny_model, False, (5, 5, 6))[0] == [0, 0, 0]


def test_the_env_worker_tags_each_episode_with_its_iteration(tiny_model) -> None:
    """What the sandbox's slots see during an episode is the iteration the router dispatched it for."""
    import numpy as np

    from mas_async.config import load_config
    from mas_async.deployment import Deployment
    from mas_async.rollout.env_worker import EnvWorker
    from mas_async.wire.messages import RunEpisode
    from mas_async.wire.samples import Completion
    from tests.support.paths import ROOT

    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["algorithm.k=2"])
    worker = EnvWorker(config, Deployment("tcp://127.0.0.1:1", {}, {"vertical": str(tiny_model),
                                                                   "horizontal": str(tiny_model)}), 0)  # fmt: skip
    seen: list[int] = []

    async def generate(policy: str, prompt_ids, n: int, greedy: bool) -> list[Completion]:
        seen.append(episode_iteration.get())
        token = np.array([worker.stop_ids[policy][0]], dtype=np.int32)
        return [Completion(token, np.zeros(1, dtype=np.float32), 0, "stop") for _ in range(n)]

    worker.generate, worker.send = generate, lambda message: None
    problem = worker.env_cls.problems("train", 1, **config.env.options)[0]

    async def two_iterations() -> None:
        await asyncio.gather(
            worker._run_episode(RunEpisode("train7-0", 7, "train", 0, "p0", problem, 0, 6)),
            worker._run_episode(RunEpisode("train8-0", 8, "train", 0, "p0", problem, 0, 7)),
        )

    asyncio.run(two_iterations())
    assert sorted(set(seen)) == [7, 8] and episode_iteration.get() == 0


def test_a_cancelled_waiter_neither_takes_nor_loses_a_slot() -> None:
    async def scenario() -> None:
        slots = PrioritySlots(1)
        await slots.acquire()
        episode_turn.set(0)
        cancelled = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0)
        episode_turn.set(5)
        later = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        slots.release()  # the slot skips the cancelled waiter
        await asyncio.wait_for(later, 1.0)
        slots.release()
        assert slots.free == 1

    asyncio.run(scenario())


def test_no_slots_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        PrioritySlots(0)
