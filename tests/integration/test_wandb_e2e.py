"""`mas-async train ... metrics.wandb.mode=offline` through the real CLI: the router logs every row of
metrics.jsonl to an offline W&B run in the run directory (what `wandb sync` uploads), read back from W&B's
own run file (tests/support/wandb_records.py)."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from mas_async.wandb_run import RUN_ID_FILE, WANDB_DIR
from tests.integration.launch import FAST, run_train
from tests.support.wandb_records import read_run

pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install -e '.[wandb]')")


def test_two_iterations_log_the_metrics_rows_to_an_offline_wandb_run(tmp_path):
    run_dir = tmp_path / "run"
    rc, out = run_train(
        "configs/plan_path_tiny.yaml", run_dir, "run.iterations=2", *FAST,
        "metrics.wandb.mode=offline", "metrics.wandb.tags=[e2e]",
    )  # fmt: skip
    assert rc == 0, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]

    run_id = (run_dir / WANDB_DIR / RUN_ID_FILE).read_text().strip()
    files = list((run_dir / WANDB_DIR).glob(f"offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1, sorted(p.name for p in (run_dir / WANDB_DIR).iterdir())
    logged = read_run(files[0])
    assert len(logged["history"]) == len(rows)
    for got, want in zip(logged["history"], rows, strict=True):
        assert set(got) == set(want), set(got) ^ set(want)
        for key, value in want.items():
            assert got[key] == value or (math.isnan(got[key]) and math.isnan(value)), (key, got[key], value)
    for key in ("team/success_rate", "policy/vertical/version_mismatch", "policy/horizontal/logprob_abs_diff"):
        assert key in logged["history"][0]
    # The resolved config, as the run directory's config.yaml holds it; the run's name and tags.
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert {key: logged["config"][key] for key in resolved} == resolved
    assert logged["run"].display_name == "plan_path_tiny-run" and list(logged["run"].tags) == ["e2e"]
    assert logged["run"].job_type == "train"
