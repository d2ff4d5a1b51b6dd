"""The game envs end to end through `mas-async train`: each tiny config (role-specialised and role-sharing)
and the custom-node example of docs/extending.md run 2 iterations with every role a real process, and no episode
fails (an exception in a node, an env or a workflow would be counted as dropped)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.integration.launch import FAST, ROOT, cleanup, start_train

CONFIGS = {
    "configs/sokoban_tiny.yaml": {"vertical": "vertical", "horizontal": "horizontal"},
    "configs/sokoban_tiny_shared.yaml": {"vertical": "shared", "horizontal": "shared"},
    "configs/sudoku_tiny.yaml": {"chooser": "chooser", "placer": "placer"},
    "configs/sudoku_tiny_shared.yaml": {"chooser": "shared", "placer": "shared"},
    "configs/plan_path_10x10_tiny.yaml": {"vertical": "vertical", "horizontal": "horizontal"},
    "configs/examples/custom_node.yaml": {"vertical": "shared", "horizontal": "shared"},
}


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_two_iterations_end_to_end(config: str, tmp_path) -> None:
    run_dir = tmp_path / "run"
    proc = start_train(config, run_dir, "run.iterations=2", *FAST)
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [0, 1, 2]  # 2 training iterations + the final evaluation
    agents = CONFIGS[config]
    for i, row in enumerate(rows[:2]):
        assert row["rollout/episodes"] == 4 and row["rollout/dropped"] == 0, row
        assert 0.0 <= row["team/success_rate"] <= 1.0
        for agent in agents:
            assert f"reward/{agent}" in row, (agent, row)
        for policy in set(agents.values()):
            assert row[f"policy/{policy}/version"] == i
            assert row[f"policy/{policy}/version_mismatch"] == 0
            assert row[f"policy/{policy}/samples"] > 0
    assert "eval/team_success_rate" in rows[2]


def test_a_node_outside_the_repo_plugs_in_by_path(tmp_path, monkeypatch) -> None:
    """The promise of docs/extending.md: a user's module, anywhere on the Python path, named in the config."""
    user_dir = tmp_path / "user_code"
    user_dir.mkdir()
    source = (ROOT / "nodes" / "examples" / "compass.py").read_text()
    (user_dir / "my_compass.py").write_text(source)
    monkeypatch.setenv("PYTHONPATH", str(user_dir))  # inherited by the launcher and every child
    run_dir = tmp_path / "run"
    overrides = [f"agents.{agent}.node=my_compass:CompassMover" for agent in ("vertical", "horizontal")]
    proc = start_train("configs/examples/custom_node.yaml", run_dir, "run.iterations=1", *FAST, *overrides)
    try:
        out, _ = proc.communicate(timeout=400)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out
    resolved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert resolved["agents"]["vertical"]["node"] == "my_compass:CompassMover"
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["rollout/dropped"] == 0 and rows[0]["policy/shared/samples"] > 0
