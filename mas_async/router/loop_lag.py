"""How late the router's event loop runs: what the control plane adds to every message it handles.

A message ready on the router's socket waits for the loop as long as any timer does, so a timer every
`interval_s` and how long past its time it fires measure that wait (plus libuv's timer granularity, ~1 ms);
the handler's own time comes on top. Of each tick's lag, the part the loop's thread spent running (its CPU
time over the gap, at most the lag) is the router's own work; the rest is time the operating system gave
other processes (on a shared machine). Each metrics row gets the ticks since the previous row:
`router/loop_lag_p50_ms`, `_p99_ms`, `_max_ms`, and `router/loop_work_lag_p99_ms`, `_max_ms` (left out of
a row with no tick), and the counts that add up over rows: the ticks (`router/loop_lag_ticks`) and how many
of them ran over each of `OVER_MS` (`Keys.loop_lag_over`), from which `pooled_percentile` bounds a percentile
of a window of rows (a row's own p99 is of the row's ticks alone: tens to hundreds).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from typing import Any

import numpy as np

from mas_async.metrics import Keys

INTERVAL_S = 0.02
"""Seconds between ticks (50 a second: a few microseconds of the loop's time per second)."""
OVER_MS = (1, 2, 3, 4, 5, 6, 8, 10)
"""Lags, in ms, of which each row counts the ticks that ran later."""
KEPT_TICKS = 200_000
"""The most ticks kept between two rows (over an hour at `INTERVAL_S`; the latest are kept)."""


class LoopLag:
    """`run` ticks on the loop it runs on; `take` returns the ticks' lag figures since the last call."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        if interval_s <= 0:
            raise ValueError(f"a loop-lag interval must be positive, got {interval_s}")
        self.interval_s = interval_s
        self.ticks: deque[tuple[float, float]] = deque(maxlen=KEPT_TICKS)
        """(seconds past its time that a tick ran, of which the loop's thread was running)."""

    async def run(self) -> None:
        due = time.monotonic() + self.interval_s
        cpu = time.thread_time()
        while True:
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now, cpu_now = time.monotonic(), time.thread_time()
            lag = max(0.0, now - due)
            self.ticks.append((lag, min(lag, cpu_now - cpu)))
            due, cpu = now + self.interval_s, cpu_now

    def take(self) -> dict[str, float]:
        """The ticks' lag since the last `take`, in milliseconds (empty with no tick)."""
        if not self.ticks:
            return {}
        lags = np.array(self.ticks, dtype=np.float64) * 1000
        self.ticks.clear()
        wall, work = lags[:, 0], lags[:, 1]
        return {
            Keys.LOOP_LAG_P50_MS: float(np.percentile(wall, 50)),
            Keys.LOOP_LAG_P99_MS: float(np.percentile(wall, 99)),
            Keys.LOOP_LAG_MAX_MS: float(wall.max()),
            Keys.LOOP_WORK_LAG_P99_MS: float(np.percentile(work, 99)),
            Keys.LOOP_WORK_LAG_MAX_MS: float(work.max()),
            Keys.LOOP_LAG_TICKS: len(lags),
            **{Keys.loop_lag_over(ms): int((wall > ms).sum()) for ms in OVER_MS},
            **{Keys.loop_lag_over(ms, work=True): int((work > ms).sum()) for ms in OVER_MS},
        }


def pooled_percentile(rows: list[dict[str, Any]], q: float, work: bool = False) -> float | None:
    """An upper bound of the q-th percentile of the lag (its own work's with `work`) over all the ticks of
    `rows` (metrics rows; those without the counts are left out): the least of `OVER_MS` that at most
    (100 - q)% of the ticks ran over. None with no tick, or with more than that over the largest."""
    if not 0 <= q <= 100:
        raise ValueError(f"a percentile is between 0 and 100, got {q}")
    counted = [row for row in rows if Keys.LOOP_LAG_TICKS in row]
    ticks = sum(row[Keys.LOOP_LAG_TICKS] for row in counted)
    for ms in OVER_MS if ticks else ():
        if sum(row[Keys.loop_lag_over(ms, work)] for row in counted) <= ticks * (100 - q) / 100:
            return float(ms)
    return None
