"""The router's loop-lag probe (router/loop_lag.py): a blocked loop shows, an idle one does not, and a row
with no tick gets no figure."""

from __future__ import annotations

import asyncio
import time

import pytest

from mas_async.metrics import Keys
from mas_async.router.loop_lag import OVER_MS, LoopLag, pooled_percentile

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)


def test_a_blocked_loop_shows_in_the_lag_and_each_take_starts_afresh():
    async def scenario() -> tuple[dict, dict, dict]:
        lag = LoopLag(interval_s=0.005)
        task = asyncio.get_running_loop().create_task(lag.run())
        await asyncio.sleep(0.2)
        idle = lag.take()
        await asyncio.sleep(0.01)
        time.sleep(0.15)  # a handler that holds the loop for 150 ms
        await asyncio.sleep(0.05)
        blocked = lag.take()
        empty = lag.take()  # no tick since: no figure
        task.cancel()
        return idle, blocked, empty

    idle, blocked, empty = asyncio.run(scenario())
    assert idle[Keys.LOOP_LAG_MAX_MS] < 100, idle  # (2 shared cores: a loop that only ticks is not 100 ms late)
    assert 0.0 <= idle[Keys.LOOP_LAG_P50_MS] <= idle[Keys.LOOP_LAG_P99_MS] <= idle[Keys.LOOP_LAG_MAX_MS]
    assert blocked[Keys.LOOP_LAG_MAX_MS] >= 130, blocked  # the tick due during the 150 ms ran that much late
    assert blocked[Keys.LOOP_LAG_P50_MS] < blocked[Keys.LOOP_LAG_MAX_MS]  # one late tick among on-time ones
    assert blocked[Keys.LOOP_WORK_LAG_MAX_MS] <= blocked[Keys.LOOP_LAG_MAX_MS]
    assert empty == {}


def test_a_loop_that_waits_off_the_cpu_is_late_but_not_by_its_own_work():
    """The 150 ms hold again, once busy (the thread computes) and once asleep (as when the operating
    system runs other processes): the same lag, but only the busy one is the loop's own work."""

    async def hold(work: bool) -> dict:
        lag = LoopLag(interval_s=0.005)
        task = asyncio.get_running_loop().create_task(lag.run())
        await asyncio.sleep(0.05)
        end = time.monotonic() + 0.15
        while work and time.monotonic() < end:
            pass
        time.sleep(max(0.0, end - time.monotonic()))
        await asyncio.sleep(0.03)
        task.cancel()
        return lag.take()

    busy, asleep = asyncio.run(hold(True)), asyncio.run(hold(False))
    assert busy[Keys.LOOP_LAG_MAX_MS] >= 130 and asleep[Keys.LOOP_LAG_MAX_MS] >= 130
    assert busy[Keys.LOOP_WORK_LAG_MAX_MS] >= 60, busy  # (on 2 shared cores the thread may not run all along)
    assert asleep[Keys.LOOP_WORK_LAG_MAX_MS] < 20, asleep


def test_a_row_before_any_tick_has_no_lag_figure_and_a_bad_interval_is_refused():
    assert LoopLag().take() == {}
    with pytest.raises(ValueError, match="loop-lag interval must be positive"):
        LoopLag(interval_s=0)


def test_a_row_counts_its_ticks_over_each_lag_and_rows_pool_into_a_window_percentile():
    """A held loop's late tick is counted over every lag it passed; over a window of rows, the p99's bound is
    of all their ticks together, not the worst row's own p99 (a row of a few ticks has its worst as its p99)."""

    async def scenario() -> dict:
        lag = LoopLag(interval_s=0.005)
        task = asyncio.get_running_loop().create_task(lag.run())
        await asyncio.sleep(0.01)
        time.sleep(0.03)  # one tick 20-30 ms late
        await asyncio.sleep(0.02)
        task.cancel()
        return lag.take()

    row = asyncio.run(scenario())
    assert row[Keys.LOOP_LAG_TICKS] >= 3
    assert row[Keys.loop_lag_over(10)] >= 1  # the held tick
    counts = [row[Keys.loop_lag_over(ms)] for ms in OVER_MS]
    assert counts == sorted(counts, reverse=True) and counts[0] < row[Keys.LOOP_LAG_TICKS]
    assert all(row[Keys.loop_lag_over(ms, work=True)] <= row[Keys.loop_lag_over(ms)] for ms in OVER_MS)

    def counted(ticks: int, over: dict[float, int]) -> dict:
        """A row of `ticks` ticks, `over[ms]` of them over ms (0 where not named), its own work none."""
        return {
            Keys.LOOP_LAG_TICKS: ticks,
            **{Keys.loop_lag_over(ms): over.get(ms, 0) for ms in OVER_MS},
            **{Keys.loop_lag_over(ms, work=True): 0 for ms in OVER_MS},
        }

    quiet = counted(980, {1: 30, 2: 8})  # 3% over 1 ms, 0.8% over 2 ms
    burst = counted(20, {1: 3, 2: 3, 3: 3, 4: 3, 5: 3, 6: 2})  # its own p99 is past 6 ms
    assert pooled_percentile([quiet, burst], 99) == 3.0  # 11 of 1,000 ticks over 2 ms (> 1%), 3 over 3 ms
    assert pooled_percentile([burst], 99) == 8.0  # alone: 2 of its 20 over 6 ms, none over 8 ms
    assert pooled_percentile([quiet, burst], 99, work=True) == 1.0  # (the least lag counted)
    assert pooled_percentile([counted(10, dict.fromkeys(OVER_MS, 1))], 95) is None  # 10% past the largest: no bound
    assert pooled_percentile([{"iteration": 3}], 99) is None  # no counts, no tick
    with pytest.raises(ValueError, match="between 0 and 100"):
        pooled_percentile([quiet], 101)
