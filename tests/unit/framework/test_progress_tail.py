"""The launcher's progress display follows metrics.jsonl: each row parsed once, a bounded few kept in memory,
a half-written last line left for the next poll, a file rewritten by a whole-run restart read again from its
start, and what it prints the same as reading the whole file at every poll printed."""

from __future__ import annotations

import gc
import json
import tracemalloc
from pathlib import Path
from typing import Any

import pytest

from mas_async.config import load_config
from mas_async.launch.comparison import baselines_line, comparison_lines
from mas_async.launch.progress import ETA_WINDOW, Progress
from mas_async.metrics import Keys, keep_rows_before
from mas_async.untrained import due_to_say, untrained_policies
from tests.support.paths import ROOT

REAL_EVAL_ROWS = ROOT / "results/demo-seed0/eval.jsonl"
"""The held-out evaluation rows of a real demo run (with the baselines in the first)."""


def _progress(tmp_path: Path) -> Progress:
    return Progress(load_config(ROOT / "configs/plan_path_tiny.yaml", [f"run.output_dir={tmp_path}"]), tmp_path)


def _train_row(iteration: int) -> dict[str, Any]:
    """A training iteration's row, about the size of a real one."""
    row: dict[str, Any] = {"iteration": iteration, "time/elapsed_s": 10.0 + 1.5 * iteration, "time/rollout_s": 1.0}
    row |= {"team/success_rate": (iteration % 7) / 7, "rollout/tokens_per_s": 900.0 + iteration % 50}
    for policy in ("vertical", "horizontal"):
        row |= {f"policy/{policy}/{key}": float(iteration % 13) for key in ("loss", "kl", "entropy", "grad_norm")}
        row |= {f"policy/{policy}/logprob_abs_diff": 1e-9, f"policy/{policy}/version_mismatch": 0}
        row |= {f"policy/{policy}/samples": 16, f"policy/{policy}/active_samples": 8}
    return row | {"reward/vertical": 0.25, "reward/horizontal": -0.5}


def _append(path: Path, rows: list[dict[str, Any]]) -> None:
    with path.open("a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def _printed_iterations(out: str) -> list[int]:
    return [int(line.split()[1].split("/")[0]) for line in out.splitlines() if line.startswith("iter ")]


def test_a_growing_file_is_parsed_once_and_kept_in_bounded_memory(tmp_path, capsys, monkeypatch) -> None:
    """5,000 rows over 100 polls: every row parsed exactly once (not the whole file at every poll), and the
    memory the display holds after 5,000 rows is what it held after 1,000 (the rows are not all kept)."""
    parsed = []
    loads = json.loads
    monkeypatch.setattr(json, "loads", lambda text, *a, **k: parsed.append(1) or loads(text, *a, **k))
    progress = _progress(tmp_path)
    path = tmp_path / "metrics.jsonl"
    rows = [_train_row(i) for i in range(5000)]
    held = {}
    tracemalloc.start()
    try:
        for start in range(0, len(rows), 50):
            _append(path, rows[start : start + 50])
            progress.update()
            if start + 50 in (1000, 5000):
                capsys.readouterr()  # the captured lines are the test's, not the display's
                gc.collect()
                held[start + 50] = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held[5000] - held[1000] < 256 << 10, held  # 4,000 more rows kept would be megabytes
    assert len(parsed) == len(rows)
    assert len(progress.recent) == ETA_WINDOW + 1 and progress.latest["iteration"] == 4999


def test_a_half_written_last_line_waits_for_its_end(tmp_path, capsys) -> None:
    progress = _progress(tmp_path)
    path = tmp_path / "metrics.jsonl"
    _append(path, [_train_row(i) for i in range(3)])
    last = json.dumps(_train_row(3))
    with path.open("a") as f:
        f.write(last)  # whole JSON, but no newline yet: the writer is not done with the line
    progress.update()
    with path.open("a") as f:
        f.write("\n" + json.dumps(_train_row(4))[:40])
    progress.update()
    assert _printed_iterations(capsys.readouterr().out) == [0, 1, 2, 3]
    with path.open("a") as f:
        f.write(json.dumps(_train_row(4))[40:] + "\n")
    progress.update()
    progress.update()
    assert _printed_iterations(capsys.readouterr().out) == [4]
    assert progress.read == 5 and progress.latest == _train_row(4)


@pytest.mark.parametrize("how", ["replaced", "truncated"])
def test_a_file_rewritten_shorter_is_read_again_from_its_start(tmp_path, capsys, how) -> None:
    """A whole-run restart resumes at iteration 20 (the one Progress told so): the router rewrites metrics.jsonl
    with the rows before it
    (a new file renamed over the old, as `keep_rows_before` does; or, `truncated`, the same file cut short),
    then writes iterations 20.. again. The rows kept are not printed again, the new ones once each, and what
    the display holds comes from the rewritten file alone (no row counted twice, nothing of a dropped row)."""
    progress = _progress(tmp_path)
    path = tmp_path / "metrics.jsonl"
    rows = [_train_row(i) for i in range(30)]
    for iteration in (0, 10, 25):
        rows[iteration] |= {"eval/team_success_rate": iteration / 100, "eval/episodes": 64}
    _append(path, rows)
    progress.update()
    assert _printed_iterations(capsys.readouterr().out) == list(range(30))
    progress.restarted(20)  # as the launcher does before it starts the run again
    if how == "replaced":
        keep_rows_before(path, 20)
    else:
        with path.open("r+") as f:
            f.truncate(sum(len(json.dumps(row)) + 1 for row in rows[:20]))
    progress.update()
    assert _printed_iterations(capsys.readouterr().out) == []
    assert progress.read == 20 and progress.last_eval == 0.1  # iteration 25's evaluation was dropped
    _append(path, [_train_row(i) for i in range(20, 25)])
    progress.update()
    assert _printed_iterations(capsys.readouterr().out) == [20, 21, 22, 23, 24]
    assert [row["iteration"] for row in progress.recent] == list(range(24 - ETA_WINDOW, 25))
    assert progress.last_eval_row is not None and progress.last_eval_row["iteration"] == 10


def _whole_file_output(progress: Progress, rows: list[dict[str, Any]]) -> list[str]:
    """What the display printed for `rows` when it read the whole file at every poll and kept every row: each
    row's line with the ETA over all the rows before it, its untrained policies and baselines; the summary."""
    lines = []
    for index, row in enumerate(rows):
        lines.append(progress._line(row, rows[: index + 1]))
        for policy, why in untrained_policies(row, list(progress.cfg.policies)).items():
            if due_to_say(row, policy):
                streak = row.get(f"policy/{policy}/untrained_iterations")
                times = f" ({streak} iterations in a row)" if isinstance(streak, int) and streak > 1 else ""
                lines.append(f"  policy {policy} trained nothing{times}: {why}")
        if Keys.baselines(row):
            lines.append(f"  baselines, held-out team success: {baselines_line(row)}")
    return lines + comparison_lines(rows, list(progress.cfg.agents))


def test_what_is_printed_is_what_reading_the_whole_file_printed(tmp_path, capsys) -> None:
    """A real run's evaluation rows (results/, the baselines in the first) among training rows, appended in
    uneven pieces cut anywhere, mid-line too: the lines and the summary are those of the whole file read at
    once, row by row, the ETA of each line included."""
    evals = [json.loads(line) for line in REAL_EVAL_ROWS.read_text().splitlines()]
    rows = []
    for row in evals[:20]:
        base = row["iteration"]
        rows += [_train_row(i) for i in range(base, base + 5)]
        rows[-1] |= {"policy/horizontal/active_samples": 0, "policy/horizontal/reward_mean": 0.0}  # trained nothing
        rows[-5] |= row  # the evaluation is written with the first iteration of its period
    text = "".join(json.dumps(row) + "\n" for row in rows).encode()
    progress = _progress(tmp_path)
    capsys.readouterr()
    path = tmp_path / "metrics.jsonl"
    cut = 0
    for step in range(len(text) // 997 + 1):
        end = min(len(text), cut + 997 + 131 * (step % 5))
        with path.open("ab") as f:
            f.write(text[cut:end])
        cut = end
        progress.update()
    progress.summary()
    printed = capsys.readouterr().out.splitlines()
    reference = _progress(tmp_path)
    reference.baselines = progress.baselines  # measured in the first row: beside every evaluation line
    capsys.readouterr()
    assert printed == _whole_file_output(reference, rows)
    etas = [line.split("  eta ")[1] for line in printed if line.startswith("iter ")]
    assert len(etas) == len(rows) and "-" not in etas and len(set(etas)) > 10
    assert any(line.startswith("  baselines, held-out team success:") for line in printed)
    assert any(line.startswith("  policy horizontal trained nothing") for line in printed)
    assert any(line.startswith("policy (iteration 95)") for line in printed)


def _real_sized_row(iteration: int, elapsed_s: float) -> dict[str, Any]:
    """A row about the size of the soak's (4 KB): a training row and 80 more per-policy figures."""
    row = _train_row(iteration) | {"time/elapsed_s": elapsed_s}
    return row | {f"policy/vertical/extra_{k}": iteration + k / 7 for k in range(80)}


def test_a_resumed_run_reads_a_long_file_in_bounded_memory_and_prints_only_its_own_rows(tmp_path, capsys) -> None:
    """A launcher that resumes a run at iteration 3,000 (by hand, or in a whole-run restart) reads its 12 MB
    metrics.jsonl from the start: it parses it a batch at a time (its peak does not grow with the file, which a
    single read of every row did: the launcher's +4 MB per restart in the soak), prints only the iterations
    from 3,000 on, and its ETA comes from the resumed run's clock alone (that clock starts again at 0)."""
    path = tmp_path / "metrics.jsonl"
    _append(path, [_real_sized_row(i, 10.0 + 2.0 * i) for i in range(3000)])
    assert path.stat().st_size > 10e6
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", [f"run.output_dir={tmp_path}", "run.iterations=3010"])
    progress = Progress(config, tmp_path, start_version=3000)
    capsys.readouterr()
    gc.collect()
    tracemalloc.start()
    try:
        progress.update()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # 8 rows at a time: 0.27 MB (the whole file parsed at once: 39 MB; 64 rows at a time: 1.7 MB, which the soak saw
    # stay in the launcher's RSS after its first whole-run restart, the interpreter keeping its high-water mark)
    assert peak < 0.5e6, peak
    assert progress.read == 3000 and capsys.readouterr().out == ""
    _append(path, [_real_sized_row(3000 + i, 5.0 + 3.0 * i) for i in range(3)])
    progress.update()
    printed = capsys.readouterr().out.splitlines()
    assert _printed_iterations("\n".join(printed)) == [3000, 3001, 3002]
    assert printed[-1].endswith("eta 21s")  # 7 iterations to go at 3 s each (not the old run's 2 s, nor negative)
