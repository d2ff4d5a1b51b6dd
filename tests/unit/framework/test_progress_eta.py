"""The progress display's ETA: remaining iterations times the recent time per iteration."""

from __future__ import annotations

import pytest

from mas_async.launch.progress import ETA_WINDOW, duration, eta_seconds


def test_no_rows_no_eta() -> None:
    assert eta_seconds([], 10) is None


def test_one_row_uses_its_phase_times_not_the_start_up() -> None:
    row = {"iteration": 0, "time/elapsed_s": 12.0, "time/rollout_s": 1.5, "time/step_s": 0.5}
    assert eta_seconds([row], 10) == pytest.approx(9 * 2.0)
    assert eta_seconds([{"iteration": 0, "time/elapsed_s": 12.0}], 10) == pytest.approx(9 * 12.0)


def test_recent_rows_set_the_pace() -> None:
    # The start-up made the first iteration slow; the ETA follows the last ETA_WINDOW iterations only.
    rows = [{"iteration": 0, "time/elapsed_s": 100.0}]
    rows += [{"iteration": i, "time/elapsed_s": 100.0 + 2.0 * i} for i in range(1, ETA_WINDOW + 5)]
    last = rows[-1]["iteration"]
    assert eta_seconds(rows, 100) == pytest.approx((100 - 1 - last) * 2.0)


def test_finished_run_has_no_time_left() -> None:
    rows = [{"iteration": i, "time/elapsed_s": float(i)} for i in range(5)]
    rows.append({"iteration": 5, "time/elapsed_s": 6.0})  # the final evaluation pass
    assert eta_seconds(rows, 5) == 0.0


@pytest.mark.parametrize(("seconds", "text"), [(None, "-"), (0.4, "0s"), (45, "45s"), (192, "3m12s"), (3720, "1h02m")])
def test_duration(seconds: float | None, text: str) -> None:
    assert duration(seconds) == text
