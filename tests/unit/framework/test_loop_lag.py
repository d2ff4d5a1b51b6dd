"""The router's loop-lag probe (router/loop_lag.py): a blocked loop shows, an idle one does not, and a row
with no tick gets no figure."""

from __future__ import annotations

import asyncio
import time

import pytest

from mas_async.metrics import Keys
from mas_async.router.loop_lag import LoopLag


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
