"""Bounded staleness (`rollout.max_staleness=1`) end to end through real processes: rollouts of the next
iteration run during each step, every sample is at most one version old, none is refused, and the
rollout log-probs match the trainer's recompute under the weights that generated each sample."""

from __future__ import annotations

import json

from tests.integration.launch import FAST, cleanup, start_train


def test_k1_run_overlaps_rollout_and_training_and_stays_within_the_window(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_train("configs/plan_path_tiny.yaml", run_dir, "run.iterations=4", *FAST, "eval.every=2",
                       "rollout.max_staleness=1")  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4]
    stale = 0
    for i, row in enumerate(rows[:4]):
        assert row["rollout/episodes"] == 4 and row["rollout/dropped"] == 0
        assert "time/trainer_idle_s" in row and "time/inference_idle_s" in row
        assert 0.0 <= row["rollout/multi_version_token_fraction"] <= 1.0
        for policy in ("vertical", "horizontal"):
            key = f"policy/{policy}/"
            assert row[key + "version"] == i
            assert row[key + "version_mismatch"] == 0 and row[key + "stale_dropped"] == 0
            assert row[key + "staleness_max"] <= 1
            assert row[key + "logprob_abs_diff"] < 1e-4  # under the version that produced each sample
            assert row[key + "stale_unchecked_samples"] == 0
            stale += row[key + "stale_samples"]
    assert stale > 0, "no sample was generated during a step: the rollouts never overlapped the training"
    assert "eval/team_success_rate" in rows[4]
