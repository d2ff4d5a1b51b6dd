"""End to end through `mas-async train` for the code and math envs: each tiny config runs 2 iterations
(role-specialised and role-sharing), every role a real process, episodes scored in env workers.

The tiny model writes garbage, so most candidates are invalid and get the penalty: these runs prove the
pipeline (prompts, parsing, penalties, groups, training, weight sync) works, not that anything learns.
Sandbox execution itself is covered by the unit tests and tests/integration/test_humaneval_reference.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.integration.launch import ROOT, cleanup, start_train

FAST = ["run.iterations=2", "rollout.batch_size=2", "algorithm.k=2", "eval.every=1", "eval.size=2"]


def _shared(config: str, tmp_path: Path) -> str:
    """A copy of `config` where one policy serves every agent (role-sharing)."""
    data = yaml.safe_load((ROOT / config).read_text())
    first = next(iter(data["policies"]))
    data["policies"] = {"shared": data["policies"][first]}
    for spec in data["agents"].values():
        spec["policy"] = "shared"
    path = tmp_path / Path(config).name.replace(".yaml", "_shared.yaml")
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.parametrize(
    ("config", "policies"),
    [
        ("configs/code_tiny.yaml", ["coder", "tester"]),
        ("configs/code_tiny_shared.yaml", ["shared"]),
        ("configs/math_tiny.yaml", ["reasoner", "tool_user"]),
        ("configs/math_tiny_shared.yaml", ["shared"]),
        ("configs/math_routed_tiny.yaml", ["solver", "verifier"]),
        ("routed-shared", ["shared"]),
    ],
)
def test_two_iterations(tmp_path: Path, config: str, policies: list[str]) -> None:
    if config == "routed-shared":
        config = _shared("configs/math_routed_tiny.yaml", tmp_path)
    run_dir = tmp_path / "run"
    proc = start_train(config, run_dir, *FAST)
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]  # 2 training iterations + the final evaluation
    agents = yaml.safe_load((run_dir / "config.yaml").read_text())["agents"]
    for i, row in enumerate(rows[:2]):
        assert row["rollout/dropped"] == 0 and row["rollout/episodes"] == 2
        for agent in agents:
            assert f"reward/{agent}" in row
        for policy in policies:
            assert row[f"policy/{policy}/version"] == i
            assert row[f"policy/{policy}/version_mismatch"] == 0
            assert row[f"policy/{policy}/samples"] > 0
            assert row[f"policy/{policy}/logprob_abs_diff"] < 1e-4
    assert "eval/team_success_rate" in rows[2]
