"""The distributed optimiser (`trainer.distributed_optimizer`) on 2 and 4 trainer ranks (real processes, gloo
on 127.0.0.1): each rank holds the model in the policy's dtype and 1/N of the master and Adam state; the
update equals one rank's without it (float32 policy: parameters within 1e-6 after a step; bf16: the update
of the float32 master within bf16 rounding), a rank with no sample still joins, the streamed step makes the
batch step's update, and a checkpoint resumes every rank exactly (and re-shards onto one rank)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from mas_async import preloaded_processes
from tests.integration.test_data_parallel import _leave, _port
from tests.unit.framework.test_micro_batches import batch

DO = "trainer.distributed_optimizer=true"
BF16 = "policies.vertical.dtype=bfloat16"


def _config(*overrides: str):
    from mas_async.config import load_config
    from tests.support.paths import ROOT

    return load_config(ROOT / "configs/plan_path_tiny.yaml", ["policies.vertical.lr=1e-5", *overrides])


def _alone(model_path: str, samples: list, *overrides: str):
    """One rank's learner after its step on every sample, and the step's metrics."""
    from mas_async.training.learner import PolicyLearner

    torch.manual_seed(0)
    learner = PolicyLearner(_config(*overrides), "vertical", model_path)
    return learner, learner.step(samples, 0)


def _rank(rank: int, world: int, port: int, model_path: str, shares: list, overrides: list, out: dict) -> None:
    from mas_async.training.data_parallel import DataParallel, merge_metrics
    from mas_async.training.learner import PolicyLearner

    torch.set_num_threads(1)
    dp = DataParallel.join(
        policy="vertical", device="cpu", host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=60
    )
    try:
        torch.manual_seed(0)
        learner = PolicyLearner(_config(*overrides), "vertical", model_path, dp=dp)
        start = learner.distributed.master[0].clone()
        mine = learner.step(shares[rank], 0)
        per_rank = dp.gather(mine)
        out[f"bytes{rank}"] = mine["optimizer_state_bytes"]
        out[f"master{rank}"] = (start, learner.distributed.master[0].clone())
        out[f"dtypes{rank}"] = sorted({str(p.dtype) for p in learner.model.parameters()})
        if rank == 0:
            out["metrics"] = merge_metrics(per_rank)
            out["params"] = [p.detach().clone() for _, p in learner.trained]
        _leave(dp)
    finally:
        dp.close()  # reached on an error only


def _spawn(target, world: int, *args) -> dict:
    out = mp.Manager().dict()
    preloaded_processes.spawn(target, (world, _port(), *args, out), nprocs=world)
    return dict(out)


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from mas_async.tiny_model import materialise

    return str(materialise("builtin:tiny-char", tmp_path_factory.mktemp("models")))


@pytest.mark.parametrize("world", [2, 4], ids=["2-ranks", "4-ranks-one-empty"])
def test_ranks_make_the_update_of_one_rank_with_a_float32_policy(model_path, world):
    samples = batch(model_path, count=12)  # 3 groups of 4, whole groups per rank
    shares = [samples[:4], samples[4:]] if world == 2 else [samples[:4], samples[4:8], [], samples[8:]]
    alone, expected = _alone(model_path, samples)
    start = [p.detach().clone() for _, p in _alone(model_path, [], DO)[0].trained]
    out = _spawn(_rank, world, model_path, shares, [DO])
    moved = max(float((a.detach() - s).abs().max()) for (_, a), s in zip(alone.trained, start, strict=True))
    assert moved > 5e-6  # the step did change the weights
    for (_, a), b in zip(alone.trained, out["params"], strict=True):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    metrics = out["metrics"]
    assert metrics["ranks"] == world and metrics["samples"] == 12
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7)
    # Each rank counts its shard's changes; summed over the ranks, the share of the whole master.
    assert metrics["trainer/changed_fraction"] == pytest.approx(expected["trainer/changed_fraction"], abs=1e-3)
    # A rank holds 1/N of the float32 master (4 bytes a parameter) and of Adam's moments (8), where one rank
    # without the distributed optimiser holds Adam's whole (its model is the master).
    params = sum(p.numel() for p in alone.model.parameters())
    for rank in range(world):
        assert out[f"bytes{rank}"] == pytest.approx(12 * params / world, rel=0.01)
        assert out[f"bytes{rank}"] == pytest.approx(1.5 * expected["optimizer_state_bytes"] / world, rel=0.01)


def test_a_bf16_policy_on_two_ranks_trains_the_float32_master_as_one_rank_does(model_path):
    """bf16 weights and gradients on each rank, computed without autocast, against one rank's float32 master
    computed under autocast: the gradients differ by bf16 rounding, so Adam's first step (about lr times the
    gradient's sign) moves the master the same way but where a gradient is near 0."""
    samples = batch(model_path, count=12)
    alone, expected = _alone(model_path, samples, BF16)
    out = _spawn(_rank, 2, model_path, [samples[:4], samples[4:]], [DO, BF16])
    assert out["dtypes0"] == out["dtypes1"] == ["torch.bfloat16"]
    first = torch.cat([p.detach().flatten() for p in _alone(model_path, [], BF16)[0].model.parameters()])
    after = torch.cat([p.detach().flatten() for _, p in alone.trained])
    start, master = (torch.cat([out[f"master{r}"][i] for r in range(2)])[: first.numel()] for i in (0, 1))
    assert torch.equal(start, first.to(torch.bfloat16).float())  # the master starts from the bf16 weights
    lr = 1e-5
    ours, theirs = master - start, after - first
    assert float(ours.abs().max()) <= 1.01 * lr and float((ours.abs() > 0.5 * lr).float().mean()) > 0.95
    assert float(((ours - theirs).abs() > 0.5 * lr).float().mean()) < 0.02
    assert out["metrics"]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=0.01)
    assert out["metrics"]["trainer/changed_fraction"] > 0.95  # every master entry moves, below a bf16 ulp


def _stream_rank(rank: int, world: int, port: int, model_path: str, shares: list, overrides: list, out: dict) -> None:
    from mas_async.training.data_parallel import DataParallel, merge_metrics
    from tests.unit.framework.test_streaming import learner, params, streamed

    torch.set_num_threads(1)
    dp = DataParallel.join(
        policy="shared", device="cpu", host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=60
    )
    try:
        stream = learner(model_path, *overrides, dp=dp)
        metrics = merge_metrics(dp.gather(streamed(stream, shares[rank], set(range(len(shares[rank]))))))
        if rank == 0:
            out["params"], out["metrics"] = params(stream), metrics
        _leave(dp)
    finally:
        dp.close()  # reached on an error only


def test_the_streamed_step_on_two_ranks_one_idle_makes_one_rank_s_batch_step(model_path):
    """Rank 0 streams every problem in passes, rank 1 receives nothing and meets it at the finish only."""
    from tests.unit.framework.test_streaming import CASES, episodes, learner, params

    overrides = CASES["agent_turn-agent"]
    delivered = episodes(model_path, parallel=False)
    batch_learner = learner(model_path, *overrides)
    start = params(batch_learner)
    expected = batch_learner.step([s for _, _, samples in delivered for s in samples], 0)
    out = _spawn(_stream_rank, 2, model_path, [delivered, []], [*overrides, DO])
    pa, pb, p0 = (torch.cat([p.flatten() for p in ps]) for ps in (out["params"], params(batch_learner), start))
    assert float((pb - p0).abs().max()) > 5e-5
    assert float((pa - pb).norm()) <= 1e-6 * float(pb.norm())
    assert out["metrics"]["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)


def _resume_rank(rank: int, world: int, port: int, model_path: str, shares: list, run_dir: str, out: dict) -> None:
    from mas_async.checkpoint import load_policy_state, policy_checkpoint, save_policy
    from mas_async.training.data_parallel import DataParallel
    from mas_async.training.learner import PolicyLearner

    torch.set_num_threads(1)
    config = _config(DO, BF16, "policies.vertical.lr=1e-3", "algorithm.mini_batches=2")
    dp = DataParallel.join(
        policy="vertical", device="cpu", host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=60
    )
    try:
        learner = PolicyLearner(config, "vertical", model_path, dp=dp)
        learner.step(shares[rank], 0)
        save_policy(Path(run_dir), "vertical", 1, learner)  # every rank writes its shard; rank 0 the folder
        dp.gather(None)  # the folder is complete before anyone reads it
        saved = learner.distributed.shard_state()  # (its tensors on the CPU are the live ones: copied)
        out[f"saved{rank}"] = {key: [t.clone() for t in saved[key]] for key in ("master", "exp_avg", "exp_avg_sq")}
        folder = str(policy_checkpoint(Path(run_dir), "vertical", 1))
        resumed = PolicyLearner(config, "vertical", folder, dp=dp)
        load_policy_state(Path(run_dir), "vertical", 1, resumed)
        for ours in (learner, resumed):
            ours.step(shares[rank], 1)
        a, b = learner.distributed, resumed.distributed
        out[f"diff{rank}"] = max(
            float((x - y).abs().max())
            for pairs in ((a.buffers, b.buffers), (a.master, b.master), (a.exp_avg_sq, b.exp_avg_sq))
            for x, y in zip(*pairs, strict=True)
        )
        _leave(dp)
    finally:
        dp.close()  # reached on an error only


def test_a_checkpoint_resumes_every_rank_exactly_and_re_shards_onto_one(model_path, tmp_path):
    """Two ranks save a checkpoint (one shard file each) after two optimiser steps and resume from it: the
    next step from the checkpoint is the very step of the run that went on (bf16 weights, master and Adam
    state bit for bit). One rank loading the same checkpoint holds the two shards' master and moments."""
    from mas_async.checkpoint import load_policy_state, policy_checkpoint
    from mas_async.training.learner import PolicyLearner

    samples = batch(model_path, count=16)
    out = _spawn(_resume_rank, 2, model_path, [samples[:8], samples[8:]], str(tmp_path))
    assert out["diff0"] == out["diff1"] == 0.0
    folder = policy_checkpoint(tmp_path, "vertical", 1)
    assert sorted(p.name for p in folder.glob("optimizer-*")) == [
        "optimizer-rank00000-of-00002.pt", "optimizer-rank00001-of-00002.pt"
    ]  # fmt: skip
    config = _config(DO, BF16, "policies.vertical.lr=1e-3", "algorithm.mini_batches=2")
    one = PolicyLearner(config, "vertical", str(folder))
    load_policy_state(tmp_path, "vertical", 1, one)
    numel = one.distributed.numels[0]
    for key in ("master", "exp_avg", "exp_avg_sq"):
        whole = torch.cat([out[f"saved{r}"][key][0] for r in range(2)])[:numel]
        assert torch.equal(getattr(one.distributed, key)[0][:numel], whole), key
    assert float(one.distributed.state[one.distributed.param_groups[0]["params"][0]]["step"]) == 2.0
    served = torch.cat([p.detach().flatten() for p in one.model.parameters()])
    assert torch.equal(served, one.distributed.master[0][:numel].to(torch.bfloat16))  # the folder: the master, cast
