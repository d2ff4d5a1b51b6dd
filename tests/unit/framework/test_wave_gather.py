"""When an inference server takes its queue as a batch (WaveGather), with requests arriving on a timer."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest

from mas_async.inference.server import WaveGather

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)


def _gather(gather: WaveGather, schedule: list[tuple[float, int]], n: int = 1) -> tuple[int, float]:
    """Requests arrive at the given (seconds after the start, count) moments; return (how many were
    queued when `wait` returned, seconds it took)."""

    async def scenario() -> tuple[int, float]:
        queue: list = []

        async def arrive() -> None:
            start = time.monotonic()
            for at, count in schedule:
                await asyncio.sleep(max(0.0, start + at - time.monotonic()))
                queue.extend(SimpleNamespace(n=n) for _ in range(count))
                gather.arrived()

        feeder = asyncio.create_task(arrive())
        await asyncio.sleep(0)  # the first arrivals (at 0) are queued before the wait starts
        t0 = time.monotonic()
        await gather.wait(queue)
        took = time.monotonic() - t0
        taken = len(queue)
        feeder.cancel()
        return taken, took

    return asyncio.run(scenario())


def test_before_any_batch_it_waits_for_a_short_silence_only() -> None:
    gather = WaveGather(gap_s=0.02, fraction=0.1, capacity=512)
    taken, _ = _gather(gather, [(0.0, 1), (0.005, 1), (0.01, 1), (0.3, 5)])
    assert taken == 3  # the late ones (0.3 s) are the next batch's


def test_the_rest_of_an_expected_wave_is_waited_for_past_the_short_gap() -> None:
    gather = WaveGather(gap_s=0.01, fraction=0.1, capacity=512)
    gather.batch_done(requests=16, seconds=1.0)  # a long gap of 0.1 s until 16 requests are queued
    taken, took = _gather(gather, [(0.0, 3), (0.05, 13), (0.5, 4)])
    assert taken == 16  # the 13 that came 50 ms later (5 short gaps) made the batch; the late 4 did not
    assert took < 0.4  # once the wave was complete, only a short silence followed


def test_an_incomplete_wave_waits_at_most_the_fraction_of_a_batch() -> None:
    gather = WaveGather(gap_s=0.01, fraction=0.1, capacity=512)
    gather.batch_done(requests=16, seconds=1.0)
    taken, took = _gather(gather, [(0.0, 10)])  # six episodes finished: their requests never come
    assert taken == 10
    assert 0.09 <= took < 0.6  # about the long gap (0.1 s), well under a batch (1 s)


def test_capacity_ends_the_wait_at_once() -> None:
    gather = WaveGather(gap_s=0.05, fraction=0.5, capacity=16)
    gather.batch_done(requests=8, seconds=2.0)
    taken, took = _gather(gather, [(0.0, 2)], n=8)  # 2 requests of n=8 fill 16 sequences
    assert taken == 2 and took < 0.04


def test_a_steady_trickle_is_cut_off_after_the_last_batch_duration() -> None:
    gather = WaveGather(gap_s=0.02, fraction=0.1, capacity=10_000)
    gather.batch_done(requests=1000, seconds=0.2)
    taken, took = _gather(gather, [(i * 0.01, 1) for i in range(100)])
    assert 0.15 <= took < 0.5 and taken < 100
