"""bench/machine_cpu.py: the machine's busy CPU sampled over a run, read between rows and instants."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.machine_cpu import CpuTimeline, cpu_seconds

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)


def test_rows_are_timed_as_they_appear_and_cpu_is_read_between_them(tmp_path: Path) -> None:
    rows = tmp_path / "metrics.jsonl"
    with CpuTimeline(rows=rows, interval_s=0.02) as cpu:
        time.sleep(0.1)  # no file yet: no row
        rows.write_text('{"iteration": 0}\n')
        time.sleep(0.1)
        before = time.time()
        end = time.process_time() + 0.3
        while time.process_time() < end:  # 0.3 s of this process's CPU between the two rows
            pass
        with rows.open("a") as f:
            f.write('{"iteration": 1}\n{"iteration": 2}\n')
        time.sleep(0.1)
    assert len(cpu.row_seen) == 3 and cpu.row_seen[1] == cpu.row_seen[2]
    assert cpu.row_seen[0] < before <= cpu.row_seen[1] <= before + 0.3 + 1.0
    busy = cpu.busy_between(cpu.row_seen[0], cpu.row_seen[1])
    assert 0.25 <= busy <= 0.3 + 2 * (cpu.row_seen[1] - cpu.row_seen[0])  # at least the loop's own CPU
    assert cpu.busy == sorted(cpu.busy) and cpu.times == sorted(cpu.times)


def test_interpolates_between_samples_and_refuses_outside_them() -> None:
    cpu = CpuTimeline()
    cpu.times, cpu.busy = [10.0, 12.0], [100.0, 103.0]
    assert cpu.busy_at(11.0) == pytest.approx(101.5) and cpu.busy_at(12.0) == 103.0
    assert cpu.busy_between(10.0, 12.0) == pytest.approx(3.0)
    with pytest.raises(ValueError, match="outside the sampled span"):
        cpu.busy_at(12.5)
    with pytest.raises(ValueError, match="interval_s must be positive"):
        CpuTimeline(interval_s=0)
    assert cpu_seconds() > 0
