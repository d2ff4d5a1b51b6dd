"""`mas-async eval` (avg@k, pass@k from a run's checkpoint) and the ablation bench's smoke mode, which
runs every variant (single agent, parallel sampling with trajectory groups, AT-GRPO, per-agent
normalisation) and the role-swap probe, and the tool + plan team's probes, through real deployments."""

from __future__ import annotations

import json
import subprocess
import sys

from bench.ablation import TOOLPLAN_ROWS
from tests.integration.launch import FAST, ROOT, cleanup, start_train


def test_eval_reports_avg_and_pass_at_k_from_a_checkpoint(tmp_path):
    train_dir = tmp_path / "train"
    proc = start_train("configs/plan_path_tiny.yaml", train_dir, "run.iterations=2", *FAST)
    try:
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
    finally:
        cleanup(proc, train_dir)
    eval_dir = tmp_path / "eval"
    result = subprocess.run(
        [sys.executable, "-m", "mas_async", "eval", "configs/plan_path_tiny.yaml", f"checkpoint={train_dir}",
         "eval.k=3", "eval.greedy=false", "eval.size=6", f"run.output_dir={eval_dir}"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    row = json.loads((eval_dir / "eval.json").read_text())
    assert row["iteration"] == 2  # the checkpoint's version
    assert row["eval/episodes"] == 18  # 6 problems x k=3
    assert 0.0 <= row["eval/avg@3"] <= row["eval/pass@3"] <= 1.0
    # the env's reference policies on the same problems and episode seeds, and the table that lines them up
    # Each reference policy: every problem's k episodes, eval.baseline_draws (20) times.
    assert row["eval/baseline/random/episodes"] == 360 and row["eval/baseline/optimal/team_success_rate"] == 1.0
    assert "baseline always_U_L" in result.stdout and "policy (iteration 2)" in result.stdout
    assert not (eval_dir / "logs" / "trainer-vertical.log").exists()  # no trainer in an evaluation


def test_eval_config_mistakes_are_sentences(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "mas_async", "eval", "configs/plan_path_tiny.yaml", "eval.k=3"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "eval.greedy=false" in result.stderr
    result = subprocess.run(
        [sys.executable, "-m", "mas_async", "eval", "configs/plan_path_tiny.yaml", f"checkpoint={tmp_path}"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2 and "no complete checkpoint" in result.stderr


def test_ablation_smoke_runs_every_variant(tmp_path):
    result = subprocess.run(
        [sys.executable, "bench/ablation.py", "--smoke", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    table = json.loads((tmp_path / "ablation.json").read_text())
    for name in ("single agent + GRPO", "multi-agent + GRPO", "multi-agent + AT-GRPO",
                 "multi-agent + AT-GRPO + per-agent std", "shared policy + AT-GRPO + per-agent std",
                 "single agent + AT-GRPO", "AT-GRPO policies with roles swapped"):  # fmt: skip
        assert len(table[name]) == 1 and 0.0 <= table[name][0] <= 1.0
    assert (tmp_path / "ablation.png").stat().st_size > 1000
    assert "| multi-agent + AT-GRPO |" in result.stdout


def test_ablation_smoke_runs_the_tool_plan_probes(tmp_path):
    result = subprocess.run(
        [sys.executable, "bench/ablation.py", "--smoke", "--team", "toolplan", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    table = json.loads((tmp_path / "ablation.json").read_text())
    assert set(table) == {"iterations", "seeds", *TOOLPLAN_ROWS}
    for name in TOOLPLAN_ROWS:
        assert len(table[name]) == 1 and 0.0 <= table[name][0] <= 1.0
    # each role trained alone, on its own env, with only its own agent
    for role, other in (("tool", "plan"), ("plan", "tool")):
        rows = [json.loads(line) for line in (tmp_path / f"toolplan-{role}-alone-seed0/metrics.jsonl").open()]
        assert f"reward/{role}" in rows[0] and f"reward/{other}" not in rows[0]
    # the combined team plays with the alone runs' weights; the swapped one with the joint run's, crossed
    combined = json.loads((tmp_path / "toolplan-combined-seed0/deployment.json").read_text())["weights_paths"]
    assert combined == {
        p: str(tmp_path / f"toolplan-{p}-alone-seed0/checkpoints/{p}/v000001") for p in ("tool", "plan")
    }
    swapped = json.loads((tmp_path / "toolplan-swapped-seed0/deployment.json").read_text())["weights_paths"]
    assert swapped == {"tool": str(tmp_path / "toolplan-joint-seed0/checkpoints/plan/v000001"),
                       "plan": str(tmp_path / "toolplan-joint-seed0/checkpoints/tool/v000001")}  # fmt: skip
    assert "| tool + plan, each trained alone, then combined |" in result.stdout
