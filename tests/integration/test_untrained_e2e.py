"""A run whose rewards are all equal trains nothing: each such iteration says so on the progress line, naming
the policy and the cause, and after `trainer.max_untrained_iterations` in a row the run stops with the named
error, at once (a restart would train nothing the same way)."""

from __future__ import annotations

import json

from tests.integration.launch import FAST, run_train

ZERO = "tests.support.constant_rewards"


def test_a_run_whose_rewards_are_constant_says_it_trains_nothing_then_stops_with_a_named_error(tmp_path):
    run_dir = tmp_path / "run"
    rc, out = run_train(
        "configs/plan_path_tiny.yaml", run_dir, *FAST, "run.iterations=8", "eval.every=0",
        f"env.name={ZERO}:ZeroRewardPlanPath", f"agents.vertical.node={ZERO}:ZeroVertical",
        f"agents.horizontal.node={ZERO}:ZeroHorizontal", "trainer.max_untrained_iterations=2", timeout=300,
    )  # fmt: skip
    assert rc != 0, out
    assert "policy vertical trained nothing: none of its" in out and "had a non-zero advantage" in out, out
    assert "trained nothing for 2 iterations in a row" in out and "NothingTrained: policy" in out, out
    assert "restarting the run" not in out, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1]
    for i, row in enumerate(rows):
        for policy in ("vertical", "horizontal"):
            assert row[f"policy/{policy}/active_samples"] == 0 and row[f"policy/{policy}/samples"] > 0
            assert row[f"policy/{policy}/untrained_iterations"] == i + 1
