"""`mas-async bench CONFIG`: a rollout-only deployment of any config, measured (real processes).
A smoke run, --baseline, --sweep, the plot, and the sentences for bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.support.paths import ROOT

SMALL = ["rollout.batch_size=2", "algorithm.k=2", "workflow.options.max_turns=2", "env.train_size=16"]


def _bench(tmp_path: Path, *args: str, config: str = "configs/plan_path_tiny.yaml") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mas_async", "bench", str(ROOT / config), f"run.output_dir={tmp_path / 'run'}", *args],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )  # fmt: skip


def test_bench_measures_each_policy_and_the_baseline_replays_the_same_prompts(tmp_path):
    proc = _bench(tmp_path, *SMALL, "--phases", "2", "--warmup", "1", "--baseline")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "run" / "bench.json").read_text())
    (result,) = summary["results"]
    total = result["total"]
    assert total["dropped"] == 0 and total["tokens"] > 0 and total["episodes_per_s"] > 0
    assert set(result["policies"]) == {"vertical", "horizontal"}
    assert sum(p["tokens"] for p in result["policies"].values()) == total["tokens"]
    assert all(0 < r["busy_fraction"] <= 1 for r in result["replicas"].values()) and len(result["replicas"]) == 2
    assert {"router", "env_worker-0", "env_worker-1", "inference-vertical-0"} <= set(result["processes"])
    assert result["router"]["messages_per_s"] > 0 and result["episode_time"]["waiting_for_generation_s"] > 0
    for policy, alone in result["baseline"].items():  # the same prompts: max_tokens 1, one token each
        assert alone["tokens"] == result["policies"][policy]["tokens"] and alone["overhead_ratio"] > 0
    assert "overhead ratio" in proc.stdout and "tokens/s" in proc.stdout
    plot = subprocess.run(
        [sys.executable, "-m", "mas_async", "plot", str(tmp_path / "run")], capture_output=True, text=True, timeout=120
    )
    assert plot.returncode == 0, plot.stderr
    assert (tmp_path / "run" / "plots" / "throughput.png").stat().st_size > 1000


def test_sweep_measures_each_setting_with_its_scaling_efficiency(tmp_path):
    proc = _bench(tmp_path, *SMALL, "--phases", "1", "--warmup", "0", "--sweep", "cluster.env_workers=1,2")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((tmp_path / "run" / "bench.json").read_text())
    assert [r["setting"] for r in summary["results"]] == [{"cluster.env_workers": 1}, {"cluster.env_workers": 2}]
    assert [len([p for p in r["processes"] if p.startswith("env_worker")]) for r in summary["results"]] == [1, 2]
    assert summary["scaling"][0]["efficiency"] == 1.0 and summary["scaling"][1]["efficiency"] > 0
    assert "scaling:" in proc.stdout


def test_bad_input_is_a_sentence(tmp_path):
    proc = _bench(tmp_path, "--sweep", "cluster.env_wrkers=1,2")
    assert proc.returncode == 2 and "unknown key 'cluster.env_wrkers'" in proc.stderr
    proc = _bench(tmp_path, "--sweep", "cluster.env_workers")
    assert proc.returncode == 2 and "not of the form" in proc.stderr
    proc = _bench(tmp_path, f"checkpoint={tmp_path}")
    assert proc.returncode == 2 and "no complete checkpoint" in proc.stderr
    other = tmp_path / "other-run"
    other.mkdir()
    (other / "config.yaml").write_text((ROOT / "configs/plan_path_tiny_shared.yaml").read_text())
    proc = _bench(tmp_path, f"checkpoint={other}")
    assert proc.returncode == 2 and "does not match the config" in proc.stderr and "'shared'" in proc.stderr


def test_a_parallel_workflow_with_sandboxed_code_is_measured_per_episode(tmp_path):
    """Agents acting at once (code: coder + tester) send requests from tasks of their own; each request
    is still credited to its episode, and the episode's waits are a union, never more than the episode."""
    proc = _bench(
        tmp_path, "policies.shared.backend=bench.lockstep:ScriptedEngine", "rollout.batch_size=2",
        "rollout.max_tokens=8", "--phases", "1", "--warmup", "0", config="configs/code_tiny_shared.yaml",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (result,) = json.loads((tmp_path / "run" / "bench.json").read_text())["results"]
    split = result["episode_time"]
    assert result["total"]["requests"] > 0 and result["total"]["dropped"] == 0
    assert 0 < split["waiting_for_generation_s"] <= split["episode_s"] and split["in_env_s"] > 0
