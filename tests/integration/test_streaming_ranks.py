"""The streamed step on 2 trainer ranks (real processes, gloo on 127.0.0.1): each rank streams its share of
the problems (whole problems, as the router sends them) in its own order and passes, accumulating under
DDP's no_sync, and the one all-reduce at the end gives the update of 1 rank's batch step on the union
(gradients within float rounding, parameters within 1e-6 relative); with ZeRO, with LoRA, and with a rank
that received nothing."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from mas_async import preloaded_processes
from tests.integration.test_data_parallel import _leave, _port
from tests.unit.framework.test_streaming import CASES, episodes, grads, orders, params


def _rank(
    rank: int, world: int, port: int, model_path: str, shares: list, overrides: list, lr: float, out: dict,
    second: list | None = None,
) -> None:  # fmt: skip
    from mas_async.training.data_parallel import DataParallel, merge_metrics
    from tests.unit.framework.test_streaming import learner, streamed

    torch.set_num_threads(1)
    dp = DataParallel.join(
        policy="shared", device="cpu", host="127.0.0.1", port=port, rank=rank, world_size=world, timeout_s=60
    )
    try:
        stream = learner(model_path, *overrides, lr=lr, dp=dp)
        order, cuts = orders(shares[rank], seed=rank) if shares[rank] else ([], set())
        metrics = merge_metrics(dp.gather(streamed(stream, order, cuts)))
        if second is not None:  # a second step: this rank's passes now run at other moments than the other's
            metrics = merge_metrics(dp.gather(streamed(stream, second[rank], set(range(len(second[rank]))))))
        if rank == 0:
            out["params"], out["grads"], out["metrics"] = params(stream), grads(stream), metrics
        _leave(dp)
    finally:
        dp.close()  # reached on an error only


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    from mas_async.tiny_model import materialise

    return str(materialise("builtin:tiny-char", tmp_path_factory.mktemp("models")))


@pytest.mark.parametrize(
    "case, extra, split",
    [
        ("agent_turn-agent", [], 2),
        ("trajectory", ["trainer.zero=true"], 1),
        ("agent_turn-group", ["policies.shared.lora={r: 4}"], 2),
        ("agent_turn-agent", [], 4),  # rank 1 receives nothing
    ],
    ids=["ddp", "zero-trajectory", "lora", "empty-rank"],
)
def test_two_ranks_stream_the_update_of_one(model_path, case, extra, split):
    from tests.unit.framework.test_streaming import learner

    overrides = [*CASES[case], *extra]
    delivered = episodes(model_path, parallel="algorithm.sampling=parallel" in overrides)
    by_problem: dict[str, list] = {}
    for item in delivered:
        by_problem.setdefault(item[2][0].problem_id, []).append(item)
    problems = list(by_problem.values())
    shares = [sum(problems[:split], []), sum(problems[split:], [])]  # whole problems per rank
    lr = 1e-4  # as the unit tests' (`learner`): Adam's first step turns rounding near its eps into steps
    batch = learner(model_path, *overrides, lr=lr)
    start = params(batch)
    expected = batch.step([s for _, _, samples in delivered for s in samples], 0)
    out = mp.Manager().dict()
    preloaded_processes.spawn(_rank, (2, _port(), model_path, shares, overrides, lr, out), nprocs=2)
    for x, y in zip(out["grads"], grads(batch), strict=True):
        assert float((x - y).abs().max()) <= 1e-5 * float(y.abs().max())
    pa, pb, p0 = (torch.cat([p.flatten() for p in ps]) for ps in (out["params"], params(batch), start))
    assert float((pb - p0).abs().max()) > 5e-5
    assert float((pa - pb).norm()) <= 1e-6 * float(pb.norm())
    metrics = out["metrics"]
    assert metrics["samples"] == expected["samples"] and metrics["ranks"] == 2
    assert metrics["grad_norm"] == pytest.approx(expected["grad_norm"], rel=1e-5)
    assert metrics["loss"] == pytest.approx(expected["loss"], rel=1e-5, abs=1e-7)


def test_two_streamed_steps_in_a_row_with_one_rank_idle_until_the_end(model_path):
    """DDP rebuilds its buckets with a broadcast in the first forward after its first backward: a rank
    whose first pass of the second step comes early (rank 0) and one that computes nothing before the
    finish (rank 1) must not meet in different collectives. Two steps, against one rank's two batch steps."""
    from tests.unit.framework.test_streaming import learner

    overrides = CASES["agent_turn-group"]
    delivered = episodes(model_path, parallel=False)
    shares, second = [delivered[:2], delivered[2:]], [delivered, []]
    batch = learner(model_path, *overrides)
    batch.step([s for _, _, samples in delivered for s in samples], 0)
    batch.step([s for _, _, samples in delivered for s in samples], 1)
    out = mp.Manager().dict()
    preloaded_processes.spawn(_rank, (2, _port(), model_path, shares, overrides, 1e-4, out, second), nprocs=2)
    pa, pb = (torch.cat([p.flatten() for p in ps]) for ps in (out["params"], params(batch)))
    assert float((pa - pb).norm()) <= 1e-6 * float(pb.norm())
