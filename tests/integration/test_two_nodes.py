"""A training run across two "nodes": network namespaces a and b joined by a veth pair. The router and the
trainers live on a, the env workers and inference servers on b; every listener binds its node's address,
ZeroMQ (CURVE) and the gloo weight groups cross the pair, and the strict on-policy proof holds. A client on
b without the run's key is refused and counted while the run goes on."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.integration.launch import FAST, ROOT, cleanup, start_train, wait_for_rows
from tests.integration.netns import netns_unavailable, two_nodes

pytestmark = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))


def test_training_across_two_network_namespaces(tmp_path):
    run_dir = tmp_path / "run"
    with two_nodes() as (a, b):
        proc = start_train(
            "configs/plan_path_tiny.yaml", run_dir, "run.iterations=3", *FAST,
            f"cluster.nodes=[{a.as_config()}, {b.as_config()}]",
            "cluster.placement={router: a, trainer: a, inference: b, env_worker: b}",
        )  # fmt: skip
        try:
            wait_for_rows(run_dir, 1, timeout=300)  # the run is under way
            deployment = json.loads((run_dir / "deployment.json").read_text())
            intruder = subprocess.run(
                [*b.prefix, sys.executable, "-m", "tests.integration.intruder", deployment["router_endpoint"],
                 str(run_dir / "keys"), "3"],
                capture_output=True, text=True, timeout=60, cwd=ROOT,
            )  # fmt: skip
            out, _ = proc.communicate(timeout=400)
        finally:
            cleanup(proc, run_dir)
    assert intruder.returncode == 0 and intruder.stdout.strip() == "replies=0", intruder.stdout + intruder.stderr
    assert proc.returncode == 0, out
    where = {name: place["address"] for name, place in deployment["nodes"].items()}
    assert where == {
        "router": a.address, "trainer/vertical": a.address, "trainer/horizontal": a.address,
        "inference/vertical/0": b.address, "inference/horizontal/0": b.address,
        "env_worker/0": b.address, "env_worker/1": b.address,
    }  # fmt: skip
    assert deployment["router_endpoint"].startswith(f"tcp://{a.address}:")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    for i, row in enumerate(rows[:3]):
        for policy in ("vertical", "horizontal"):
            assert row[f"policy/{policy}/version"] == i
            assert row[f"policy/{policy}/version_mismatch"] == 0
            assert row[f"policy/{policy}/logprob_abs_diff"] < 1e-4
        assert row["rollout/episodes"] == 4 and row["rollout/dropped"] == 0
    # Row 0 was written before the intruder came; its plain and its foreign-key socket were each refused
    # at least once (a refused DEALER reconnects and is refused again).
    assert rows[0]["router/refused_handshakes"] == 0 and rows[-1]["router/refused_handshakes"] >= 2
    router_log = (run_dir / "logs" / "router.log").read_text()
    assert f"from {b.address}: its CURVE key is not one of the run's processes'" in router_log, router_log[-2000:]
    # Each inference server took every version from its trainer across the pair.
    for policy in ("vertical", "horizontal"):
        log = (run_dir / "logs" / f"inference-{policy}-0.log").read_text()
        assert "weights v3" in log, log[-2000:]


def test_a_node_address_that_is_not_there_is_named(tmp_path):
    """A node whose address no interface of its namespace holds: the launcher says which node and why."""
    run_dir = tmp_path / "run"
    with two_nodes() as (a, b):
        wrong = a.as_config().replace(a.address, b.address)  # a's namespace does not hold b's address
        result = subprocess.run(
            [sys.executable, "-m", "mas_async", "train", "configs/plan_path_tiny.yaml", f"run.output_dir={run_dir}",
             f"cluster.nodes=[{wrong}]", "run.iterations=1"],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert f"mas-async: could not find free ports on node a ({b.address})" in result.stdout + result.stderr
