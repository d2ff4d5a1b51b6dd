"""Checkpoint and resume: kill -9 the whole run mid-iteration, resume it, and the metrics show every
iteration exactly once with continuous versions. The vertical policy trains LoRA adapters and the
horizontal one every weight, so both kinds of checkpoint are resumed."""

from __future__ import annotations

import json
import os
import signal
import time

from tests.integration.launch import FAST, alive, child_pids, cleanup, start_train, wait_for_rows


def test_kill_9_mid_iteration_then_resume(tmp_path):
    run_dir = tmp_path / "run"
    lora = ["policies.vertical.lora={r: 8, alpha: 16}", "policies.vertical.lr=0.01"]
    args = ["run.iterations=6", "trainer.checkpoint_every=2", *FAST, "eval.every=2", *lora]
    proc = start_train("configs/plan_path_tiny.yaml", run_dir, *args)
    try:
        pids = child_pids(run_dir)
        wait_for_rows(run_dir, 4, timeout=300)  # iterations 0-3 done: v2 and v4 are checkpointed
        for pid in [proc.pid, *pids.values()]:  # the whole run dies at once, mid-iteration 4
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=10)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
            time.sleep(0.1)
    finally:
        cleanup(proc, run_dir)
    before = [json.loads(line)["iteration"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert before[:4] == [0, 1, 2, 3]
    assert (run_dir / "checkpoints" / "router" / "v000004.json").exists()

    proc = start_train("configs/plan_path_tiny.yaml", tmp_path / "ignored", f"resume={run_dir}")
    try:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        assert "resuming" in out and "version 4" in out
    finally:
        cleanup(proc, run_dir)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3, 4, 5, 6]  # none lost, none repeated
    # The baselines were measured once, in the first evaluation; the resumed run's evaluations (4, 6) do not redo them.
    assert [r["iteration"] for r in rows if "eval/baseline/random/team_success_rate" in r] == [0]
    for i, row in enumerate(rows[:6]):
        assert row["policy/vertical/version"] == i and row["policy/horizontal/version"] == i
        for policy in ("vertical", "horizontal"):
            assert row[f"policy/{policy}/version_mismatch"] == 0
            assert row[f"policy/{policy}/logprob_abs_diff"] < 1e-4  # servers resumed with the trainer's weights
        assert row["policy/vertical/weight_sync_fraction"] < 0.5  # adapters only
    trainer_log = (run_dir / "logs" / "trainer-vertical.log").read_text()
    assert "v5" in trainer_log and "v6" in trainer_log
    assert {p.name for p in (run_dir / "checkpoints" / "vertical").iterdir()} >= {"v000002", "v000004", "v000006"}
    assert (run_dir / "checkpoints" / "vertical" / "v000006" / "adapter" / "adapter_model.safetensors").is_file()
    assert not list((run_dir / "checkpoints").glob("*/.tmp-*"))  # no half-written checkpoint left behind


def test_resume_without_checkpoint_is_a_clear_error(tmp_path):
    (tmp_path / "run").mkdir()
    proc = start_train("configs/plan_path_tiny.yaml", tmp_path / "x", f"resume={tmp_path / 'run'}")
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "no run there" in out
