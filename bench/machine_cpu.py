"""The whole machine's busy CPU, read at once or sampled over a run, for benches that say what the
machine's cores allow.

`cpu_seconds()` reads the machine's busy time now; `CpuTimeline` samples it on a thread at a fixed
interval and, for a run that writes one JSON row per iteration, when each row appeared, so that the busy
CPU between two rows (or two wall-clock instants) can be read afterwards."""

from __future__ import annotations

import bisect
import threading
import time
from pathlib import Path

import psutil


def cpu_seconds() -> float:
    """Busy CPU time of the whole machine (every CPU's user, system, irq and steal time, /proc/stat).

    Not this process's rusage: a run in a fresh sandbox ends with its pid namespace, whose processes the
    kernel reaps, so their CPU is charged to no parent (measured: 4 ms per run by rusage, 62 ms by the
    machine). The machine's time counts every process a run touches, and everything else too: run it on a
    quiet machine (`background()` says how quiet)."""
    t = psutil.cpu_times()
    return t.user + t.nice + t.system + t.irq + t.softirq + getattr(t, "steal", 0.0)


def background(seconds: float = 2.0) -> float:
    """The machine's busy CPU per second of wall time while the bench does nothing (CPU seconds per second)."""
    cpu, start = cpu_seconds(), time.perf_counter()
    time.sleep(seconds)
    return (cpu_seconds() - cpu) / (time.perf_counter() - start)


class CpuTimeline:
    """(wall time, busy CPU seconds) every `interval_s` on a thread, from `start()` to `stop()` (or the
    `with` block); and, if `rows` names a JSON-lines file, the wall time at which each of its lines was
    first seen (within one interval of when it was written)."""

    def __init__(self, rows: Path | None = None, interval_s: float = 0.2) -> None:
        if interval_s <= 0:
            raise ValueError(f"CpuTimeline: interval_s must be positive, got {interval_s}")
        self.rows, self.interval_s = rows, interval_s
        self.times: list[float] = []
        self.busy: list[float] = []
        self.row_seen: list[float] = []
        """Wall time at which line i of `rows` was first seen."""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="cpu-timeline", daemon=True)

    def __enter__(self) -> CpuTimeline:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self._record()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=10 * self.interval_s + 5)
        self._record()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._record()

    def _record(self) -> None:
        self.times.append(time.time())
        self.busy.append(cpu_seconds())
        if self.rows is not None and self.rows.is_file():
            with self.rows.open("rb") as f:
                lines = f.read().count(b"\n")
            self.row_seen += [self.times[-1]] * (lines - len(self.row_seen))

    def busy_at(self, when: float) -> float:
        """The machine's busy CPU seconds at wall time `when`, interpolated between samples."""
        if not self.times or not self.times[0] <= when <= self.times[-1]:
            raise ValueError(f"CpuTimeline: {when:.3f} is outside the sampled span")
        i = bisect.bisect_left(self.times, when)
        if self.times[i] == when or i == 0:
            return self.busy[i]
        t0, t1, b0, b1 = self.times[i - 1], self.times[i], self.busy[i - 1], self.busy[i]
        return b0 + (b1 - b0) * (when - t0) / (t1 - t0)

    def busy_between(self, start: float, end: float) -> float:
        """Busy CPU seconds of the machine between two wall times."""
        return self.busy_at(end) - self.busy_at(start)
