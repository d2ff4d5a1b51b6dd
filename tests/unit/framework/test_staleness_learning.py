"""`bench/staleness_learning.py`'s reading of runs: the evaluation curve of a metrics.jsonl, the time at
which a run first reaches the strict runs' final success (3-evaluation moving average), the table and
the figure (the runs themselves are `mas-async train` runs, tested elsewhere)."""

from __future__ import annotations

import json

import pytest

from bench.staleness_learning import curve, final, plot, summarise, time_to


def _run(tmp_path, name: str, successes: list[float], seconds_per_eval: float):
    run_dir = tmp_path / name
    run_dir.mkdir()
    rows = []
    for i, success in enumerate(successes):
        rows.append(
            {"iteration": 5 * i, "time/elapsed_s": seconds_per_eval * (i + 1), "eval/team_success_rate": success}
        )
        rows.append({"iteration": 5 * i + 1, "time/elapsed_s": seconds_per_eval * (i + 1) + 1})
    (run_dir / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return curve(run_dir)


def test_curves_targets_and_the_table(tmp_path):
    strict = _run(tmp_path, "k0", [0.1, 0.5, 0.8, 0.9, 0.9, 0.9], 10.0)
    stale = _run(tmp_path, "k1", [0.1, 0.6, 0.9, 0.9, 0.95, 0.95], 6.0)
    never = _run(tmp_path, "k2", [0.1, 0.2, 0.2, 0.3, 0.3, 0.3], 5.0)
    assert strict["iteration"] == [0, 5, 10, 15, 20, 25] and strict["wall_s"] == 61.0
    assert final(strict) == pytest.approx(0.9)
    assert time_to(stale, 0.9) == 30.0  # the moving average of evaluations 3-5 first reaches 0.9 at 5 x 6 s
    assert time_to(never, 0.9) is None
    table = summarise({0: [strict], 1: [stale], 2: [never]})
    assert table[0]["target"] == pytest.approx(0.9) and table[1]["time_to_strict_final_s"] == [30.0]
    assert table[2]["time_to_strict_final_s"] == [None]
    assert table[1]["iterations_per_min"] == [pytest.approx(60 * 26 / 37.0)]
    plot({"k=0": [strict], "k=1": [stale]}, tmp_path / "figure.png", "max_staleness", "title")
    assert (tmp_path / "figure.png").stat().st_size > 0
