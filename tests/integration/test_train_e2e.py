"""End to end through `mas-async train`: every role a real process on 127.0.0.1, talking over ZeroMQ,
weights broadcast over torch.distributed (gloo)."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import psutil
import pytest
import yaml

from envs.plan_path import PlanPathEnv
from tests.integration.launch import FAST, alive, child_pids, cleanup, run_train, start_train, wait_for_rows


def test_three_iterations_role_specialised(tmp_path):
    run_dir = tmp_path / "run"
    rc, out = run_train("configs/plan_path_tiny.yaml", run_dir, "run.iterations=3", *FAST)
    assert rc == 0, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]  # 3 training iterations + the final evaluation
    for i, row in enumerate(rows[:3]):
        for key in (
            "team/success_rate",
            "reward/vertical",
            "reward/horizontal",
            "throughput/rollout_tokens_per_s",
            "time/rollout_s",
            "time/train_s",
            "time/weight_sync_s",
            "eval/team_success_rate",
        ):
            assert key in row, key
        for policy in ("vertical", "horizontal"):
            assert row[f"policy/{policy}/version"] == i  # the version clock advances once per iteration
            assert row[f"policy/{policy}/version_mismatch"] == 0
            assert row[f"policy/{policy}/logprob_abs_diff"] < 1e-4  # servers ran exactly the trainer's weights
            assert row[f"policy/{policy}/samples"] > 0
            assert row[f"policy/{policy}/entropy"] > 0  # measured with entropy_coef 0 (the default)
            assert f"policy/{policy}/kl" not in row  # kl_coef 0: there is no reference to measure it against
        assert row["rollout/episodes"] == 4 and row["rollout/dropped"] == 0 and row["rollout/turns"] >= 1
        assert row["router/routed_requests"] > 0  # every request through the router (cluster.leases is off)
        assert not [key for key in row if key.startswith("leases/")]  # not measured without leases: absent
        # The router's loop ticks 50 times a second: each iteration's row has its lag, in ms.
        assert 0.0 <= row["router/loop_lag_p50_ms"] <= row["router/loop_lag_p99_ms"] <= row["router/loop_lag_max_ms"]
        assert 0.0 <= row["router/loop_work_lag_p99_ms"] <= row["router/loop_work_lag_max_ms"]
        # and the counts that add up over rows: its ticks, and of them those over each lag (fewer over more).
        over = [row[f"router/loop_lag_over_ms/{ms}"] for ms in (1, 2, 3, 4, 5, 6, 8, 10)]
        assert (
            row["router/loop_lag_ticks"] > 0
            and over == sorted(over, reverse=True)
            and 0 <= over[0] <= row["router/loop_lag_ticks"]
        )
        assert 0.0 <= row["team/success_rate"] <= 1.0
        assert 0.0 <= row["eval/progress_rate/vertical"] <= 1.0
    assert "eval/team_success_rate" in rows[3] and "team/success_rate" not in rows[3]
    # The env's reference policies on the same held-out problems, once per run: in the first evaluation.
    names = list(PlanPathEnv.reference_policies())
    for name in names:
        assert 0.0 <= rows[0][f"eval/baseline/{name}/team_success_rate"] <= 1.0
        # (each reference policy plays every held-out problem eval.baseline_draws times, 20 in the demo config)
        assert rows[0][f"eval/baseline/{name}/episodes"] == 20 * rows[0]["eval/episodes"] == 80
        assert f"eval/baseline/{name}/progress_rate/horizontal" in rows[0]
    assert rows[0]["eval/baseline/optimal/team_success_rate"] == 1.0  # 8 turns: every goal is in reach
    assert not [key for row in rows[1:] for key in row if key.startswith("eval/baseline/")]
    assert "baseline toward_goal" in out and "policy (iteration 3)" in out  # the end-of-run table
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["rollout"]["batch_size"] == 4 and resolved["run"]["iterations"] == 3
    logs = {p.name for p in (run_dir / "logs").iterdir()}
    assert {
        "router.log",
        "trainer-vertical.log",
        "trainer-horizontal.log",
        "env_worker-0.log",
        "env_worker-1.log",
        "inference-vertical-0.log",
        "inference-horizontal-0.log",
    } <= logs
    # Every inference server acknowledged every version (1, 2, 3), in order.
    for policy in ("vertical", "horizontal"):
        log = (run_dir / "logs" / f"inference-{policy}-0.log").read_text()
        assert [int(v) for v in _loaded_versions(log)] == [1, 2, 3]
        assert f"[inference/{policy}/0]" in log  # every line carries role and id


def _loaded_versions(log: str) -> list[str]:
    return [line.split("weights v")[1].split()[0] for line in log.splitlines() if "weights v" in line]


def test_role_sharing_one_policy_serves_both_agents(tmp_path):
    """Also the local engine without its fork server: every process a fresh interpreter."""
    run_dir = tmp_path / "run"
    rc, out = run_train(
        "configs/plan_path_tiny_shared.yaml",
        run_dir,
        "run.iterations=2",
        *FAST,
        "cluster.env_workers=2",
        "cluster.fork_server=false",
    )
    assert rc == 0, out
    assert not (run_dir / "logs" / "fork-server-local.log").exists()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["policy/shared/version"] for r in rows[:2]] == [0, 1]
    assert all(r["policy/shared/version_mismatch"] == 0 for r in rows[:2])
    assert "reward/vertical" in rows[0] and "reward/horizontal" in rows[0]


def test_two_replicas_share_the_load(tmp_path):
    run_dir = tmp_path / "run"
    rc, out = run_train(
        "configs/plan_path_tiny_shared.yaml", run_dir, "run.iterations=2", *FAST, "policies.shared.replicas=2"
    )
    assert rc == 0, out
    for r in (0, 1):
        log = (run_dir / "logs" / f"inference-shared-{r}.log").read_text()
        assert [int(v) for v in _loaded_versions(log)] == [1, 2]


def test_config_error_names_the_key(tmp_path):
    rc, out = run_train("configs/plan_path_tiny.yaml", tmp_path / "run", "rollout.batchsize=3", timeout=60)
    assert rc == 2
    assert "unknown key 'rollout.batchsize'" in out and "plan_path_tiny.yaml" in out


def test_a_crashed_role_stops_everything_and_is_named(tmp_path):
    """Without restarts (cluster.max_restarts=0; tests/integration/test_faults.py has them)."""
    run_dir = tmp_path / "run"
    proc = start_train("configs/plan_path_tiny.yaml", run_dir, "run.iterations=500", *FAST, "cluster.max_restarts=0")
    try:
        pids = child_pids(run_dir)
        wait_for_rows(run_dir, 1, timeout=300)
        victim = pids["inference/horizontal/0"]
        import os

        os.kill(victim, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)
        assert proc.returncode != 0
        assert "inference/horizontal/0" in out and "exited with status -9" in out
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
            time.sleep(0.2)
        assert not [name for name, pid in pids.items() if alive(pid)]
    finally:
        cleanup(proc, run_dir)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL])
def test_interrupt_leaves_no_process_behind(tmp_path, sig):
    """Ctrl-C or SIGTERM: the launcher stops everything. SIGKILL: its fork server sees its requests end and
    ends, and every role sees its parent change and stops."""
    run_dir = tmp_path / "run"
    proc = start_train("configs/plan_path_tiny.yaml", run_dir, "run.iterations=500", *FAST)
    try:
        pids = child_pids(run_dir)
        wait_for_rows(run_dir, 1, timeout=300)
        # Everything the launcher started, and the fork server whose children the roles are (a child of
        # the launcher, or a fork of the session's template: tests/conftest.py).
        started = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        pids.update({f"launcher child {pid}": int(pid) for pid in started})
        servers = {psutil.Process(pid).ppid() for pid in pids.values()} - {proc.pid}
        assert len(servers) == 1, servers
        pids.update({f"fork server {pid}": pid for pid in servers})
        t0 = time.monotonic()
        proc.send_signal(sig)  # what Ctrl-C does to the launcher
        proc.communicate(timeout=30)
        while time.monotonic() - t0 < 15 and any(alive(pid) for pid in pids.values()):
            time.sleep(0.1)
        assert time.monotonic() - t0 < 15
        assert proc.returncode != 0
        assert not [name for name, pid in pids.items() if alive(pid)]
    finally:
        cleanup(proc, run_dir)
