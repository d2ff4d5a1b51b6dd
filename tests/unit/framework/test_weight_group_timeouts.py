"""Every timeout of a weight group has one owner, the code's bound (DESIGN section 16): gloo and NCCL get a
longer timeout of their own, the NCCL communicator is created when the group forms (its first collective
runs then, under the code's bound), a formation that stalls there is a named error at the bound, and a
broadcast past the bound aborts the communicator before NCCL's watchdog would tear the process down.

No GPU here: a fake stands in for `ProcessGroupNCCL` and records how it was made and used; the stores, the
meeting and the join code are the real ones (two ranks in threads of this process)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from mas_async import placement
from mas_async.config import load_config
from mas_async.deployment import Deployment, free_ports
from mas_async.weights import group as group_module
from mas_async.weights.group import (
    WeightGroup,
    WeightGroupError,
    WeightGroupSpec,
    WeightSyncError,
    library_timeout_s,
    open_weight_group,
)
from tests.support.paths import ROOT

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)


class FakeWork:
    def __init__(self, done: threading.Event) -> None:
        self.done = done

    def is_completed(self) -> bool:
        return self.done.is_set()

    def wait(self, timeout: object = None) -> bool:
        self.done.wait()
        return True


class FakeNccl:
    """`dist.ProcessGroupNCCL` as the join code uses it: records its construction and every broadcast. With
    `stall`, the first broadcast never returns (a blocking `ncclCommInitRank` waiting for a lost rank)."""

    made: list[FakeNccl] = []
    stall = False

    class Options:
        def __init__(self) -> None:
            self._timeout = timedelta(0)

    def __init__(self, store: dist.Store, rank: int, world_size: int, options: FakeNccl.Options) -> None:
        self.rank, self.world_size, self.timeout = rank, world_size, options._timeout
        self.broadcasts: list[list[int]] = []
        self.aborted = threading.Event()
        FakeNccl.made.append(self)

    def broadcast(self, tensors: list[torch.Tensor], opts: object) -> FakeWork:
        self.broadcasts.append(list(tensors[0].shape))
        if FakeNccl.stall:
            self.aborted.wait(30)  # (released once the test is over)
        done = threading.Event()
        done.set()
        return FakeWork(done)

    def abort(self) -> None:
        self.aborted.set()


@pytest.fixture
def fake_nccl(monkeypatch: pytest.MonkeyPatch) -> Iterator[type[FakeNccl]]:
    FakeNccl.made, FakeNccl.stall = [], False
    monkeypatch.setattr(dist, "ProcessGroupNCCL", FakeNccl, raising=False)
    monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
    monkeypatch.setattr(group_module, "_cuda_device", lambda: torch.device("cpu"))
    # Each rank on a GPU of its own (the join checks it before NCCL starts).
    monkeypatch.setattr(placement, "this_gpu", lambda: f"GPU-{threading.current_thread().name}")
    yield FakeNccl
    for pg in FakeNccl.made:
        pg.aborted.set()


def _join_both(backend: str, timeout_s: float) -> dict[int, Any]:
    """Both ranks of a fresh 2-rank group, each in its own thread; rank -> its group or what it raised."""
    port = free_ports("127.0.0.1", 1)[0]
    out: dict[int, Any] = {}

    def join(rank: int) -> None:
        try:
            out[rank] = open_weight_group(policy="vertical", backend=backend, host="127.0.0.1", port=port,
                                          rank=rank, world_size=2, timeout_s=timeout_s)  # fmt: skip
        except Exception as e:  # recorded for the test to look at
            out[rank] = e

    threads = [threading.Thread(target=join, args=(r,), name=f"rank{r}", daemon=True) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(20)
    assert not any(t.is_alive() for t in threads), "a join outlived its bound"
    return out


def test_the_library_timeout_is_longer_than_the_code_s_bound() -> None:
    assert library_timeout_s(300.0) == 600.0
    assert library_timeout_s(5.0) == 65.0  # at least a minute more, whatever the bound
    assert all(library_timeout_s(b) > b for b in (0.1, 1.0, 60.0, 3600.0))


def test_the_nccl_process_group_gets_a_longer_timeout_and_its_first_collective_runs_at_formation(
    fake_nccl: type[FakeNccl],
) -> None:
    out = _join_both("nccl", timeout_s=5.0)
    assert all(isinstance(out[r], WeightGroup) for r in (0, 1)), out
    assert sorted(pg.rank for pg in fake_nccl.made) == [0, 1]
    for pg in fake_nccl.made:
        # Longer than the code's bound: the code's WeightSyncError comes first, never the watchdog's abort.
        assert pg.timeout == timedelta(seconds=library_timeout_s(5.0)) > timedelta(seconds=5.0)
        # The communicator is made by the first collective: one tiny broadcast when the group formed.
        assert pg.broadcasts == [[1]]


def test_the_gloo_process_group_gets_a_longer_timeout() -> None:
    out = _join_both("gloo", timeout_s=5.0)
    assert all(isinstance(out[r], WeightGroup) for r in (0, 1)), out
    assert out[0].pg.options._timeout == timedelta(seconds=65) > timedelta(seconds=5)
    a, b = torch.arange(3.0), torch.zeros(3)  # formed and usable
    sent = threading.Thread(target=out[0].broadcast, args=(a,))
    sent.start()
    out[1].broadcast(b)
    sent.join(10)
    assert torch.equal(a, b)


def test_a_formation_that_stalls_in_nccl_s_init_ends_at_the_bound_with_a_named_error(
    fake_nccl: type[FakeNccl],
) -> None:
    fake_nccl.stall = True
    began = time.monotonic()
    out = _join_both("nccl", timeout_s=1.0)
    took = time.monotonic() - began
    for rank in (0, 1):
        assert isinstance(out[rank], WeightGroupError), out[rank]
        assert f"rank {rank} of policy 'vertical''s weight group (nccl): generation 0 did not form within 1s" in str(
            out[rank]
        )
    assert 1.0 <= took < 2.0  # the code's bound, not the library's (61 s) nor NCCL's (none)
    assert all(pg.aborted.is_set() for pg in fake_nccl.made)


def test_a_broadcast_past_the_bound_aborts_the_communicator_before_the_watchdog_could() -> None:
    class NeverDone:
        def is_completed(self) -> bool:
            return False

    class Pg:
        aborted = False

        def broadcast(self, tensors: list[torch.Tensor], opts: object) -> NeverDone:
            return NeverDone()

        def abort(self) -> None:
            Pg.aborted = True

    group = WeightGroup("vertical", "nccl", 1, 2, torch.device("cpu"), Pg(), None, 0.3)  # type: ignore[arg-type]
    with pytest.raises(WeightSyncError, match=r"did not complete within 0.3 s, waiting for its trainer"):
        group.broadcast(torch.zeros(1), "bucket 1 of 1 of v2")
    assert Pg.aborted and group.pg is None and group.retired()


def test_rank_0_waits_for_the_first_generation_as_long_as_vllm_servers_may_take_to_start() -> None:
    from mas_async.startup import VLLM_START_TIMEOUT_S

    deployment = Deployment("tcp://127.0.0.1:9", {"vertical": 1, "horizontal": 2}, {"vertical": "", "horizontal": ""})
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["policies.vertical.backend=vllm"])
    spec = WeightGroupSpec.of(config, deployment, "vertical")
    bound = config.cluster.startup_timeout_s + VLLM_START_TIMEOUT_S
    assert spec.join_args(0)["join_timeout_s"] == bound
    assert spec.join_args(0)["timeout_s"] == config.trainer.weight_sync_timeout_s  # each broadcast's bound
    assert spec.join_args(1)["join_timeout_s"] == bound  # a server up first waits as long (test_first_join_bounds)
    assert spec.join_args(0, generation=1)["join_timeout_s"] == spec.timeout_s  # a re-formed generation
    hf = WeightGroupSpec.of(load_config(ROOT / "configs/plan_path_tiny.yaml"), deployment, "vertical")
    assert hf.join_args(0)["join_timeout_s"] == max(config.cluster.startup_timeout_s, hf.timeout_s)


def test_a_join_bound_longer_than_the_broadcasts_lets_a_late_rank_in() -> None:
    """Rank 1 comes 1.2 s after rank 0, whose broadcasts are bounded by 0.5 s but its join by 5 s."""
    port = free_ports("127.0.0.1", 1)[0]
    out: dict[str, Any] = {}

    def late_rank_1() -> None:
        time.sleep(1.2)
        out["1"] = open_weight_group(policy="v", backend="gloo", host="127.0.0.1", port=port, rank=1, world_size=2,
                                     timeout_s=5.0)  # fmt: skip

    late = threading.Thread(target=late_rank_1, daemon=True)
    late.start()
    group = open_weight_group(policy="v", backend="gloo", host="127.0.0.1", port=port, rank=0, world_size=2,
                              timeout_s=0.5, join_timeout_s=5.0)  # fmt: skip
    late.join(10)
    assert group.timeout_s == 0.5 and isinstance(out["1"], WeightGroup)
