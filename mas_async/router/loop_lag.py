"""How late the router's event loop runs: what the control plane adds to every message it handles.

A message ready on the router's socket waits for the loop as long as any timer does, so a timer every
`interval_s` and how long past its time it fires measure that wait (plus libuv's timer granularity, ~1 ms);
the handler's own time comes on top. Of each tick's lag, the part the loop's thread spent running (its CPU
time over the gap, at most the lag) is the router's own work; the rest is time the operating system gave
other processes (on a shared machine). Each metrics row gets the ticks since the previous row:
`router/loop_lag_p50_ms`, `_p99_ms`, `_max_ms`, and `router/loop_work_lag_p99_ms`, `_max_ms` (left out of
a row with no tick).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import numpy as np

from mas_async.metrics import Keys

INTERVAL_S = 0.02
"""Seconds between ticks (50 a second: a few microseconds of the loop's time per second)."""
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
        }
