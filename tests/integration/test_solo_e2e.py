"""The single-agent baselines end to end through `mas-async train`: each `*_tiny_single.yaml` config runs
2 iterations (batch 4, K 4, eval size 4) with every role a real process; no episode fails, updates stay
on-policy (no version mismatch, the sampler's log-probs match the trainer's) and the final evaluation runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.launch import FAST, cleanup, start_train

CONFIGS = [
    "configs/sokoban_tiny_single.yaml",
    "configs/sudoku_tiny_single.yaml",
    "configs/code_tiny_single.yaml",
    "configs/math_tiny_single.yaml",
]


@pytest.mark.parametrize("config", CONFIGS)
def test_two_iterations(config: str, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = start_train(config, run_dir, "run.iterations=2", *FAST)
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]  # 2 training iterations + the final evaluation
    for i, row in enumerate(rows[:2]):
        assert row["rollout/episodes"] == 4 and row["rollout/dropped"] == 0, row
        assert "reward/solo" in row and 0.0 <= row["team/success_rate"] <= 1.0
        assert row["policy/solo/version"] == i
        assert row["policy/solo/version_mismatch"] == 0
        assert row["policy/solo/samples"] > 0
        assert row["policy/solo/logprob_abs_diff"] < 1e-4
    assert "eval/team_success_rate" in rows[2]
