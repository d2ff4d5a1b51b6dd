"""End to end with `cluster.leases` (docs/scale.md): every role a real process on 127.0.0.1 with CURVE on, the
env workers sending their Generates straight to the replicas the router leased them and their episodes'
Groups straight to the trainers (vertical's two ranks: each problem's to one). The run trains as without leases (strict on-policy: no version mismatch,
the servers' log-probs the trainer's), and not one request or group went through the router: what the
workers sent directly is what the replicas and trainers took."""

from __future__ import annotations

import json
import re

from tests.integration.launch import FAST, run_train

POLICIES = ("vertical", "horizontal")


def test_three_iterations_with_leases_send_every_request_straight_to_a_replica(tmp_path):
    run_dir = tmp_path / "run"
    rc, out = run_train("configs/plan_path_tiny.yaml", run_dir, "run.iterations=3", *FAST, "cluster.leases=true",
                        "policies.vertical.replicas=2", "policies.vertical.trainer_ranks=2")  # fmt: skip
    assert rc == 0, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2, 3]
    for i, row in enumerate(rows[:3]):
        for policy in POLICIES:
            assert row[f"policy/{policy}/version"] == i
            assert row[f"policy/{policy}/version_mismatch"] == 0
            assert row[f"policy/{policy}/logprob_abs_diff"] < 1e-4  # servers ran exactly the trainer's weights
            assert row[f"policy/{policy}/samples"] > 0
            assert row[f"policy/{policy}/unaccepted_samples"] == 0 and row[f"policy/{policy}/repeated_episodes"] == 0
        assert row["rollout/episodes"] == 4 and row["rollout/dropped"] == 0 and row["rollout/turns"] >= 1
        # every episode's groups of each policy came straight to its trainer, and the router accepted them
        assert row["leases/direct_groups"] == sum(row[f"policy/{policy}/episodes"] for policy in POLICIES) > 0
    for row in rows:
        assert row["router/routed_requests"] == 0  # none through the router
        assert row["leases/direct_requests"] > 0 and row["leases/stale_results"] == 0
        assert row["faults/reissued_requests"] == 0
    taken = {}
    for name in ("vertical-0", "vertical-1", "horizontal-0"):
        log = (run_dir / "logs" / f"inference-{name}.log").read_text()
        assert re.search(r"taking requests directly at tcp://127\.0\.0\.1:\d+", log)
        found = re.findall(r"took (\d+) requests directly \(0 refused, 0 malformed, 0 refused handshakes\)", log)
        assert len(found) == 1, log[-2000:]
        taken[name] = int(found[0])
    assert sum(taken.values()) == sum(r["leases/direct_requests"] for r in rows)  # every one sent was taken
    assert taken["vertical-0"] > 0 and taken["vertical-1"] > 0  # both leased replicas served
    assert any(row["policy/vertical/rank_samples_min"] > 0 for row in rows[:3])  # both ranks took groups
    delivered = 0
    for trainer in ("vertical", "vertical-1", "horizontal"):
        log = (run_dir / "logs" / f"trainer-{trainer}.log").read_text()
        assert re.search(r"taking groups directly at tcp://127\.0\.0\.1:\d+", log)
        found = re.findall(r"took (\d+) groups directly \(0 refused, 0 malformed, 0 refused handshakes; 0 samples", log)
        assert len(found) == 1, log[-2000:]
        delivered += int(found[0])
    assert delivered == sum(r["leases/direct_groups"] for r in rows)
