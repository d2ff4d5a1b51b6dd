"""The tool + plan team end to end through `mas-async train`: a tiny toolplan config runs 2 iterations with
every role a real process (the tool's programs, when the tiny model writes one, run in the sandbox from
the env workers). The tiny model writes garbage, so this proves the pipeline, not learning: no episode
fails, both agents are credited, no sample is off-version and the servers ran the trainer's weights."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.launch import cleanup, start_train

CHEAP = ["run.iterations=2", "rollout.batch_size=2", "algorithm.k=2", "rollout.max_tokens=16", "eval.size=2"]


@pytest.mark.parametrize(
    "config",
    ["configs/plan_path_toolplan_tiny.yaml", "configs/sokoban_toolplan_tiny.yaml", "configs/sudoku_toolplan_tiny.yaml"],
)
def test_two_iterations(tmp_path: Path, config: str) -> None:
    run_dir = tmp_path / "run"
    proc = start_train(config, run_dir, *CHEAP, "eval.every=2")
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]  # 2 training iterations + the final evaluation
    for i, row in enumerate(rows[:2]):
        assert row["rollout/episodes"] == 2 and row["rollout/dropped"] == 0, row
        assert "reward/tool" in row and "reward/plan" in row, row
        for policy in ("tool", "plan"):
            assert row[f"policy/{policy}/version"] == i
            assert row[f"policy/{policy}/version_mismatch"] == 0
            assert row[f"policy/{policy}/samples"] > 0
            assert row[f"policy/{policy}/logprob_abs_diff"] < 1e-4
    assert "eval/team_success_rate" in rows[2]
    # The first evaluation's baselines: the solver's program ran in the sandbox of an env worker and solved
    # every held-out problem (docs/evaluation.md); random never does here.
    assert rows[0]["eval/baseline/solver/team_success_rate"] == 1.0 and rows[0]["eval/baseline/solver/episodes"] == 2
    assert 0.0 <= rows[0]["eval/baseline/random/team_success_rate"] <= 1.0
