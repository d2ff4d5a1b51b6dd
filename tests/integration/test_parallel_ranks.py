"""Parallel sampling with two trainer ranks makes one rank's update (`mas-async train`, real processes,
gloo on 127.0.0.1). Under `sampling: parallel` a problem's K episodes form one advantage group
(`grouping: trajectory`), so the router must send every episode of a problem to one rank: a rank holding
part of them would normalise over that part. The trainers record the batch of their step
(tests/support/recording_trainer.py); one rank then steps again on both ranks' batches together, and the
run's checkpoint of v1 must hold those weights."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import defaultdict

import pytest
import torch
from transformers import AutoModelForCausalLM

from mas_async.checkpoint import policy_checkpoint
from mas_async.config import load_config
from mas_async.training.advantages import compute_advantages
from mas_async.training.learner import PolicyLearner
from tests.integration.launch import ROOT, cleanup
from tests.support.recording_trainer import load_recorded

LAUNCH = (
    "import sys; from mas_async.config import load_config; from mas_async.launch.launcher import launch; "
    "sys.exit(launch(load_config(sys.argv[1], sys.argv[2:]), roles='tests.support.recording_trainer:RECORDING_ROLES'))"
)
PARALLEL = [
    "algorithm.sampling=parallel", "algorithm.grouping=trajectory", "algorithm.k=4", "rollout.batch_size=4",
    "policies.vertical.trainer_ranks=2", "policies.vertical.lr=1e-5", "run.iterations=1", "eval.size=2",
    "workflow.options.max_turns=4",
]  # fmt: skip


def test_two_ranks_under_parallel_sampling_make_the_update_of_one(tmp_path):
    run_dir = tmp_path / "run"
    command = [sys.executable, "-c", LAUNCH, str(ROOT / "configs/plan_path_tiny.yaml"), f"run.output_dir={run_dir}"]
    proc = subprocess.Popen(
        [*command, *PARALLEL], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0, out

    shares = [load_recorded(run_dir, "vertical", rank, 0) for rank in (0, 1)]
    assert all(shares), "each rank trained on some of the batch"
    problems_of = [{s.problem_id for s in share} for share in shares]
    assert not problems_of[0] & problems_of[1], f"a problem's episodes were split over the ranks: {problems_of}"
    batch = shares[0] + shares[1]
    episodes = defaultdict(set)
    for sample in batch:
        episodes[sample.problem_id].add(sample.episode_id)
    assert sorted(len(e) for e in episodes.values()) == [4, 4, 4, 4]  # every episode of the 4 problems trained
    # (4 problems, not 3: with 12 episodes all returns came out equal once in a few runs)
    assert any(compute_advantages(batch, "trajectory") != 0)  # the returns differ: the update is no no-op

    config = load_config(run_dir / "config.yaml")
    model_path = json.loads((run_dir / "deployment.json").read_text())["model_paths"]["vertical"]
    torch.manual_seed(0)
    alone = PolicyLearner(config, "vertical", model_path)
    alone_metrics = alone.step(batch, 0)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    # The gradient itself: Adam's first step is nearly blind to its scale (a sum where a mean was due
    # would move the weights alike), its norm is not.
    assert rows[0]["policy/vertical/grad_norm"] == pytest.approx(alone_metrics["grad_norm"], rel=1e-5)
    run = AutoModelForCausalLM.from_pretrained(policy_checkpoint(run_dir, "vertical", 1))
    start = AutoModelForCausalLM.from_pretrained(model_path)
    moved = max(
        float((a - b).detach().abs().max()) for a, b in zip(alone.model.parameters(), start.parameters(), strict=True)
    )
    assert moved > 5e-6
    # Adam's first step moves a weight by lr * g / (|g| + eps): where |g| is within ~100 eps of zero, the
    # rounding of a gradient summed in another order (the ranks' shares) moves it by a visible part of lr.
    # Those weights are left out (their gradient, alone's, is still in .grad after the step), and must be few.
    near_zero = 100 * alone.optimizer.defaults["eps"]
    compared = 0
    for (name, a), b in zip(alone.model.named_parameters(), run.parameters(), strict=True):
        steady = a.grad.abs() >= near_zero
        compared += int(steady.sum())
        assert torch.allclose(a[steady], b[steady], atol=1e-6, rtol=0), (
            f"{name}: the 2-rank run's update is not 1 rank's"
        )
    assert compared >= 0.9 * sum(a.numel() for a in alone.model.parameters()), "too few weights compared"
    assert rows[0]["policy/vertical/ranks"] == 2 and rows[0]["policy/vertical/version_mismatch"] == 0
