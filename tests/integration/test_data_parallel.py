"""Data-parallel trainer ranks (`policies.<p>.trainer_ranks`): 2 ranks, each with its share of a batch
(whole groups), make the same update as 1 rank on the whole batch: parameters within 1e-6 after one
step (fp32, gloo on 127.0.0.1, real processes). The same with ZeRO, with accumulation by token budget
and with LoRA adapters; and a rank with no sample at all still joins the step."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.multiprocessing as mp

from mas_async import preloaded_processes
from mas_async.tiny_model import materialise
from tests.unit.framework.test_micro_batches import batch, stepped


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _leave(dp) -> None:
    """End a rank's process once every rank is done, without tearing the group down: destroying a gloo
    group while the peer destroys its own can abort a process ("terminate called without an active
    exception", a rare SIGABRT in CI even after a final collective). The trainer's processes never
    destroy theirs either; the results are already in the manager's dict."""
    dp.gather(None)  # no rank leaves while another still works
    os._exit(0)


def _rank(rank: int, world: int, port: int, model_path: str, shares: list, overrides: list, out: dict) -> None:
    from mas_async.config import load_config
    from mas_async.training.data_parallel import DataParallel, merge_metrics
    from mas_async.training.learner import PolicyLearner
    from tests.support.paths import ROOT

    torch.set_num_threads(1)
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["policies.vertical.lr=1e-5", *overrides])
    dp = DataParallel.join(
        policy="vertical", device="cpu", host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=60
    )
    try:
        torch.manual_seed(0)
        learner = PolicyLearner(config, "vertical", model_path, dp=dp)
        metrics = merge_metrics(dp.gather(learner.step(shares[rank], 0)))
        if rank == 0:
            out["params"] = [p.detach().clone() for p in learner.model.parameters()]
        out[f"metrics{rank}"] = metrics
        _leave(dp)
    finally:
        dp.close()  # reached on an error only


def two_ranks(model_path: str, shares: list, *overrides: str) -> dict:
    manager = mp.Manager()
    out = manager.dict()
    preloaded_processes.spawn(
        _rank, (len(shares), _port(), model_path, shares, list(overrides), out), nprocs=len(shares)
    )
    return dict(out)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    return str(materialise("builtin:tiny-char", tmp_path_factory.mktemp("models")))


@pytest.mark.parametrize(
    "overrides",
    [[], ["trainer.zero=true"], ["trainer.max_tokens_per_micro_batch=12"], ["policies.vertical.lora={r: 4}"]],
    ids=["ddp", "zero", "token-budget", "lora"],
)
def test_two_ranks_make_the_update_of_one(model_path, overrides):
    samples = batch(model_path, count=12)  # 3 groups of 4
    alone, alone_metrics = stepped(model_path, samples, *overrides)
    shares = [samples[:4], samples[4:]]  # whole groups, uneven on purpose
    out = two_ranks(model_path, shares, *overrides)
    for a, b in zip(alone, out["params"], strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    metrics = out["metrics0"]
    # Adam's first step hardly sees the gradient's scale; the norm before clipping does.
    assert metrics["grad_norm"] == pytest.approx(alone_metrics["grad_norm"], rel=1e-5)
    assert metrics["loss"] == pytest.approx(alone_metrics["loss"], rel=1e-5, abs=1e-7)
    assert metrics["samples"] == 12 and metrics["ranks"] == 2
    # Of the entries the optimiser holds (with ZeRO, every rank's shard, summed over the ranks). Fresh LoRA
    # adapters: B is 0, so A gets no gradient in the first step and only B (half the entries here) moves.
    assert metrics["trainer/changed_fraction"] == pytest.approx(alone_metrics["trainer/changed_fraction"], abs=1e-3)
    assert metrics["trainer/changed_fraction"] == pytest.approx(
        0.5 if any("lora" in o for o in overrides) else 1.0, abs=0.01
    )
    if "trainer.zero=true" in overrides:  # each rank holds about half of the Adam state
        mine = metrics["optimizer_state_bytes"]
        assert 0 < mine < 0.8 * alone_metrics["optimizer_state_bytes"]


def test_a_rank_without_samples_still_joins(model_path):
    samples = batch(model_path, count=8)
    alone, alone_metrics = stepped(model_path, samples)
    out = two_ranks(model_path, [samples, []])
    for a, b in zip(alone, out["params"], strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    assert out["metrics0"]["grad_norm"] == pytest.approx(alone_metrics["grad_norm"], rel=1e-5)
    assert out["metrics0"]["rank_samples_min"] == 0


def _resume_rank(rank: int, world: int, port: int, model_path: str, shares: list, run_dir: str, out: dict) -> None:
    from pathlib import Path

    from mas_async.checkpoint import load_policy_state, policy_checkpoint, save_policy
    from mas_async.config import load_config
    from mas_async.training.data_parallel import DataParallel
    from mas_async.training.learner import PolicyLearner
    from tests.support.paths import ROOT

    torch.set_num_threads(1)
    overrides = ["policies.vertical.lr=1e-3", "trainer.zero=true", "algorithm.mini_batches=2"]
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", overrides)
    dp = DataParallel.join(
        policy="vertical", device="cpu", host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=60
    )
    try:
        learner = PolicyLearner(config, "vertical", model_path, dp=dp)
        learner.step(shares[rank], 0)
        save_policy(Path(run_dir), "vertical", 1, learner)  # collective; rank 0 writes
        dp.gather(None)  # the folder is complete before anyone reads it
        folder = str(policy_checkpoint(Path(run_dir), "vertical", 1))
        resumed = PolicyLearner(config, "vertical", folder, dp=dp)
        load_policy_state(Path(run_dir), "vertical", 1, resumed)
        assert resumed.rng.bit_generator.state == learner.rng.bit_generator.state  # this rank's own stream
        learner.step(shares[rank], 1)
        resumed.step(shares[rank], 1)
        if rank == 0:
            out["diff"] = max(
                float((a - b).detach().abs().max())
                for a, b in zip(learner.model.parameters(), resumed.model.parameters(), strict=True)
            )
        _leave(dp)
    finally:
        dp.close()  # reached on an error only


def test_zero_checkpoint_resumes_every_rank(model_path, tmp_path):
    """Two ranks with ZeRO save a checkpoint (consolidated Adam state, each rank's RNG) and resume from it:
    the next step from the checkpoint equals the next step of the run that went on."""
    samples = batch(model_path, count=16)
    shares = [samples[:8], samples[8:]]
    out = mp.Manager().dict()
    preloaded_processes.spawn(_resume_rank, (2, _port(), model_path, shares, str(tmp_path), out), nprocs=2)
    assert out["diff"] < 1e-6


def test_two_ranks_per_policy_end_to_end_with_zero_and_a_resume_after_kill_9(tmp_path):
    """`mas-async train` with 2 trainer ranks (and ZeRO) for each policy: the router shares each
    iteration's episodes between the ranks, strict on-policy holds (no mismatch, the servers run the
    trainers' weights); killed with SIGKILL, the run resumes from its checkpoint with every rank (the
    launcher allocates the ranks' group anew) and its versions continue."""
    import json
    import os
    import signal

    from tests.integration.launch import FAST, child_pids, cleanup, start_train, wait_for_rows

    run_dir = tmp_path / "run"
    ranks = ["policies.vertical.trainer_ranks=2", "policies.horizontal.trainer_ranks=2", "trainer.zero=true"]
    args = ["run.iterations=4", "trainer.checkpoint_every=2", *FAST, "eval.every=2", *ranks]
    proc = start_train("configs/plan_path_tiny.yaml", run_dir, *args)
    try:
        pids = child_pids(run_dir)
        wait_for_rows(run_dir, 3, timeout=300)  # iterations 0-2 done: v2 is checkpointed
        for pid in [proc.pid, *pids.values()]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait(timeout=10)
    finally:
        cleanup(proc, run_dir)
    proc = start_train("configs/plan_path_tiny.yaml", tmp_path / "ignored", f"resume={run_dir}")
    try:
        out, _ = proc.communicate(timeout=300)
    finally:
        cleanup(proc, run_dir)
    assert proc.returncode == 0 and "resuming" in out, out
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows][-3:] == [2, 3, 4]
    for row in rows[:-1]:
        for policy in ("vertical", "horizontal"):
            key = f"policy/{policy}/"
            assert row[key + "version"] == row["iteration"] and row[key + "ranks"] == 2
            assert row[key + "version_mismatch"] == 0 and row[key + "logprob_abs_diff"] < 1e-4
            assert row[key + "samples"] > 0
    assert any(row[f"policy/{p}/rank_samples_min"] > 0 for row in rows[:-1] for p in ("vertical", "horizontal"))
    logs = {p.name for p in (run_dir / "logs").iterdir()}
    assert {"trainer-vertical.log", "trainer-vertical-1.log", "trainer-horizontal-1.log"} <= logs
