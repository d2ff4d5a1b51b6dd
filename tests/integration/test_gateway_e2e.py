"""End to end through `mas-async train`: the OpenAI API example (nodes/examples/openai_movers.py) trains
for 2 iterations, every role a real process, each episode's program calling its env worker's gateway.

The tiny model answers noise, so this proves the path (program -> openai client -> gateway -> router ->
inference -> samples -> trainers -> weights v+1), strict on-policy in every iteration, not learning.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.integration.launch import cleanup, start_train

CONFIG = "configs/examples/openai_movers.yaml"
FAST = ["run.iterations=2", "rollout.batch_size=2", "algorithm.k=2", "eval.every=2", "eval.size=2"]


def _train(config: str, run_dir: Path, *overrides: str) -> list[dict]:
    """Train `config` quickly (`FAST`) through real processes; the rows of its metrics.jsonl."""
    proc = start_train(config, run_dir, *FAST, *overrides)
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("in_process", [True, False], ids=["in-process", "over-http"])
def test_the_openai_movers_train_on_policy(tmp_path: Path, in_process: bool) -> None:
    """The program's clients hand their calls to the gateway in-process (the default), or send them over HTTP."""
    rows = _train(CONFIG, tmp_path / "run", "workflow.options.max_turns=3", f"gateway.in_process={in_process}")
    train = [r for r in rows if "policy/vertical/version" in r]
    assert len(train) == 2, rows
    for i, row in enumerate(train):
        assert row["rollout/dropped"] == 0 and row["rollout/episodes"] == 4  # 2 problems x K=2 episodes
        for policy in ("vertical", "horizontal"):  # one policy per agent, of the same name
            assert row[f"policy/{policy}/version"] == i
            assert row[f"policy/{policy}/version_mismatch"] == 0
            assert row[f"policy/{policy}/samples"] > 0
            assert row[f"policy/{policy}/logprob_abs_diff"] < 1e-4
            assert f"reward/{policy}" in row
            # each call after an episode's first repeats its history: its ids are reused, none edited
            calls = row[f"gateway/calls/{policy}"]
            assert calls >= 1 and row[f"gateway/prefix_mismatch/{policy}"] == 0, row
            assert row[f"gateway/in_process/{policy}"] == (calls if in_process else 0), row
            assert abs(row[f"gateway/reused/{policy}"] - (calls - 1)) < 1e-9, row
    # The held-out evaluation after the last iteration runs the program too (greedy, nothing recorded).
    evaluated = [r for r in rows if "eval/episodes" in r]
    assert evaluated and all(r["eval/episodes"] == 2 and r["eval/dropped"] == 0 for r in evaluated), rows


TREE_CONFIG = "configs/examples/openai_movers_tree.yaml"


def test_the_openai_movers_train_on_policy_with_tree_sampling(tmp_path: Path) -> None:
    """The same program tree-sampled (configs/examples/openai_movers_tree.yaml): each training call is K
    candidates scored by the example's scorer, all trained on, the chosen one continuing the transcript."""
    rows = _train(TREE_CONFIG, tmp_path / "run", "workflow.options.max_turns=2")
    train = [r for r in rows if "policy/vertical/version" in r]
    assert len(train) == 2, rows
    for i, row in enumerate(train):
        assert row["rollout/dropped"] == 0 and row["rollout/episodes"] == 2  # 2 problems x 1 episode
        for policy in ("vertical", "horizontal"):
            assert row[f"policy/{policy}/version"] == i
            assert row[f"policy/{policy}/version_mismatch"] == 0
            assert row[f"policy/{policy}/logprob_abs_diff"] < 1e-4
            # K = 2 candidates of every call of the 2 episodes are samples
            calls = row[f"gateway/calls/{policy}"]
            assert calls >= 1 and abs(row[f"policy/{policy}/samples"] - 2 * 2 * calls) < 1e-9, row
            assert f"gateway/score/{policy}" in row
            # the chosen candidate continues the transcript: every later call reuses its ids, none edited
            assert row[f"gateway/prefix_mismatch/{policy}"] == 0, row
            assert abs(row[f"gateway/reused/{policy}"] - (calls - 1)) < 1e-9, row
    evaluated = [r for r in rows if "eval/episodes" in r]
    assert evaluated and all(r["eval/episodes"] == 2 and r["eval/dropped"] == 0 for r in evaluated), rows
    assert all("eval/gateway/score/vertical" not in r for r in evaluated)  # evaluation is not tree-sampled


def test_a_program_bug_that_fails_every_episode_stops_the_run_at_once_with_its_traceback(tmp_path: Path) -> None:
    """No whole-run restart first (it would fail the same way): the launcher's output shows the program's
    traceback (file, line, error) from the first failed episode."""
    proc = start_train(CONFIG, tmp_path / "run", *FAST, "workflow.program=tests.support.failing_program:play")
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        cleanup(proc, tmp_path / "run")
    assert proc.returncode == 1, out
    assert "every training episode failed" in out and "the run is not restarted" in out, out
    assert "restarting the run" not in out, out
    assert "failing_program.py" in out and "NameError: name 'undefined_progress' is not defined" in out, out
