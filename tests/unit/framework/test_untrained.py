"""A policy's iteration that trained nothing is named, with its cause, on the progress line; after
`trainer.max_untrained_iterations` in a row the router's watch stops the run with `NothingTrained`."""

from __future__ import annotations

import json

import pytest

from mas_async.config import load_config
from mas_async.launch.progress import Progress
from mas_async.untrained import NothingTrained, UntrainedWatch, due_to_say, untrained_policies, why_untrained
from tests.support.paths import ROOT

TRAINED = {"samples": 16, "active_samples": 12, "loss": 0.03, "grad_norm": 0.4, "reward_mean": 0.2}
FLAT = {"samples": 16, "active_samples": 0, "loss": 0.0, "reward_mean": 0.0}


def test_a_step_without_a_non_zero_advantage_or_without_samples_or_gradient_trained_nothing():
    assert why_untrained(TRAINED) is None
    assert "non-zero advantage" in why_untrained(FLAT) and "mean reward 0" in why_untrained(FLAT)
    assert "no sample reached" in why_untrained({"samples": 0})
    assert "exactly 0" in why_untrained({**TRAINED, "loss": 0.0, "grad_norm": 0.0})
    assert why_untrained({**TRAINED, "loss": 0.0}) is None  # a zero loss with a gradient trains (PPO's first pass)
    assert "converged" in why_untrained({**FLAT, "entropy": 0.01}) and "converged" not in why_untrained(FLAT)


def test_the_progress_line_says_a_run_of_untrained_iterations_at_its_start_and_every_tenth():
    said = [n for n in range(1, 31) if due_to_say({"policy/a/untrained_iterations": n}, "a")]
    assert said == [1, 10, 20, 30] and due_to_say({}, "a")


def test_the_watch_counts_iterations_in_a_row_and_stops_at_its_limit():
    watch = UntrainedWatch(limit=4)
    for iteration, (a, b) in enumerate([(FLAT, FLAT), (FLAT, FLAT), (TRAINED, FLAT)]):
        untrained = watch.observe({"a": a, "b": b})
        watch.check(iteration, untrained)
    assert watch.streak == {"a": 0, "b": 3}
    untrained = watch.observe({"a": TRAINED, "b": FLAT})
    assert list(untrained) == ["b"]
    with pytest.raises(NothingTrained, match=r"policy 'b' trained nothing for 4 iterations in a row .*non-zero"):
        watch.check(3, untrained)


def test_a_policy_that_trained_and_then_trains_nothing_has_converged_and_is_not_stopped():
    """The demo's movers agree on every candidate after a few hundred iterations: every advantage 0, every
    iteration said, and the run goes on; a resumed run has trained before its first iteration."""
    watch = UntrainedWatch(limit=2)
    watch.check(0, watch.observe({"a": TRAINED}))
    for iteration in range(1, 30):
        untrained = watch.observe({"a": FLAT})
        assert list(untrained) == ["a"]
        watch.check(iteration, untrained)
    assert watch.streak == {"a": 29}
    resumed = UntrainedWatch(limit=2, fresh=False)
    for iteration in range(5):
        resumed.check(iteration, resumed.observe({"a": FLAT}))


def test_a_limit_of_0_never_stops():
    watch = UntrainedWatch(limit=0)
    for iteration in range(20):
        watch.check(iteration, watch.observe({"a": FLAT}))
    assert watch.streak == {"a": 20}


def test_the_progress_line_names_the_policy_that_trained_nothing_and_why(tmp_path, capsys):
    config = load_config(ROOT / "configs/plan_path_tiny.yaml")
    row = {"iteration": 0, "policy/vertical/samples": 16, "policy/vertical/active_samples": 0,
           "policy/vertical/reward_mean": 0.0, **{f"policy/horizontal/{k}": v for k, v in TRAINED.items()}}  # fmt: skip
    assert list(untrained_policies(row, list(config.policies))) == ["vertical"]
    (tmp_path / "metrics.jsonl").write_text(json.dumps(row) + "\n")
    progress = Progress(config, tmp_path)
    progress.update()
    out = capsys.readouterr().out
    assert "policy vertical trained nothing: none of its 16 samples had a non-zero advantage" in out
    assert "policy horizontal trained nothing" not in out


def test_the_run_directory_line_is_whole_when_output_is_not_a_terminal(tmp_path, capsys):
    """Scripts read the path from this line: rich must not wrap it at its default 80 columns."""
    run_dir = tmp_path / ("a-long-folder-name-" * 6) / "plan_path_tiny" / "2026-12-07T05-30-00"
    run_dir.mkdir(parents=True)
    Progress(load_config(ROOT / "configs/plan_path_tiny.yaml"), run_dir)
    lines = capsys.readouterr().out.splitlines()
    assert f"mas-async run directory: {run_dir}" in lines, lines
