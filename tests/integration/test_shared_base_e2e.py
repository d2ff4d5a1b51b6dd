"""Two policies on one base through real processes: the vertical policy is served on the horizontal one's
inference server (`policies.vertical.base=horizontal`), each with its own LoRA adapters, trainer and
weight group. One inference process serves both; every version of each is loaded there, on-policy."""

from __future__ import annotations

import json
import re

import pytest

from mas_async.metrics import Keys
from tests.integration.launch import FAST, child_pids, cleanup, kill_when, run_train, start_train

LORA = "{r: 8, alpha: 16}"
SHARED = [
    f"policies.vertical.lora={LORA}",
    f"policies.horizontal.lora={LORA}",
    "policies.vertical.lr=0.01",
    "policies.horizontal.lr=0.01",
    "policies.vertical.base=horizontal",
]


@pytest.mark.parametrize("staleness", [0, 1], ids=["strict", "stale"])
def test_two_policies_train_their_own_adapters_on_one_inference_server(tmp_path, staleness):
    """Strict, and with bounded staleness (k=1: the shared server receives each policy's adapters while it
    generates, then swaps them in between batches)."""
    run_dir, iterations = tmp_path / "run", 3 + staleness
    args = [f"run.iterations={iterations}", *FAST, *SHARED, f"rollout.max_staleness={staleness}"]
    rc, out = run_train("configs/plan_path_tiny.yaml", run_dir, *args)
    assert rc == 0, out[-3000:]
    pids = json.loads((run_dir / "pids.json").read_text())
    assert [name for name in pids if name.startswith("inference/")] == ["inference/horizontal/0"]
    assert {"trainer/vertical", "trainer/horizontal"} <= set(pids)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r[Keys.ITERATION] for r in rows] == list(range(iterations + 1))
    for row in rows[:iterations]:
        for policy in ("vertical", "horizontal"):
            assert row[Keys.policy(policy, "version")] == row[Keys.ITERATION]
            assert row[Keys.policy(policy, Keys.VERSION_MISMATCH)] == 0
            # each policy's tokens were sampled with its own adapters: the trainer's recompute matches
            assert row[Keys.policy(policy, Keys.LOGPROB_DIFF)] < 1e-4
            assert row[Keys.policy(policy, "weight_sync_fraction")] < 0.5  # adapters only
            if staleness:
                assert row[Keys.policy(policy, "staleness_max")] <= staleness
            else:  # strict mode measures no staleness
                assert Keys.policy(policy, "staleness_max") not in row
    for policy in ("vertical", "horizontal"):  # both policies' adapters moved (a step without advantages has no norm)
        key = Keys.policy(policy, "grad_norm")
        assert max(r[key] for r in rows[: iterations - 1] if key in r) > 0
    if staleness:
        stale = sum(r[Keys.policy(p, "stale_samples")] for r in rows[:iterations] for p in ("vertical", "horizontal"))
        assert stale > 0, "no sample was generated during a step: the rollouts never overlapped the training"
    log = (run_dir / "logs" / "inference-horizontal-0.log").read_text()
    versions = [str(v) for v in range(1, iterations + 1)]
    for policy in ("vertical", "horizontal"):
        assert f"weight group of {policy} joined as rank 1" in log
        assert re.findall(rf"weights v(\d+) loaded in \S+ for {policy}\b", log) == versions


def test_the_shared_server_killed_mid_step_is_replaced_and_rejoins_both_policies_groups(tmp_path):
    """SIGKILL the one server as a step begins: the router holds both policies' requests, the replacement
    catches up alone in both weight groups (generation 2) to each policy's next version and joins them again; the run
    goes on without a restart, every iteration once, on-policy."""
    run_dir, iterations = tmp_path / "run", 5
    args = [f"run.iterations={iterations}", *FAST, "eval.every=2", *SHARED]
    proc = start_train("configs/plan_path_tiny.yaml", run_dir, *args)
    try:
        child_pids(run_dir)
        kill_when(run_dir, "inference/horizontal/0", "trainer/vertical", r"iteration 2: stepping from v2")
        out, _ = proc.communicate(timeout=300)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out[-3000:]
    assert "restarting the run" not in out and "started it again as pid" in out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r[Keys.ITERATION] for r in rows] == list(range(iterations + 1))
    assert sum(r[Keys.restarts("inference")] for r in rows) == 1
    for row in rows[:iterations]:
        for policy in ("vertical", "horizontal"):
            assert row[Keys.policy(policy, "version")] == row[Keys.ITERATION]
            assert row[Keys.policy(policy, Keys.VERSION_MISMATCH)] == 0
            assert row[Keys.policy(policy, Keys.LOGPROB_DIFF)] < 1e-4
    log = (run_dir / "logs" / "inference-horizontal-0.log").read_text(errors="replace")
    for policy in ("vertical", "horizontal"):
        # The loss took the server out at once (generation 1, no server); the replacement caught up alone
        # with the trainer (generation 2) to v3, then joined the policy's group again (generation 3).
        caught_up = f"weight group of {policy} joined as rank 1 of 2 (generation 2)"
        assert caught_up in log and f"weight group of {policy} joined as rank 1 of 2 (generation 3)" in log
        after = log[log.index(caught_up) :]
        assert re.findall(rf"weights v(\d+) loaded in \S+ for {policy}\b", after)[:1] == ["3"]
