"""When a weight group forms, its ranks check the deployment's placement against the GPUs they actually
use (`mas_async.placement.check_group_gpus`): two NCCL ranks on one GPU, or a CUDA IPC server on another
GPU than its trainer's, stop the group with an error naming the ranks, GPUs and hosts, instead of failing
inside NCCL's init or at the first mapped buffer. The GPUs are faked per thread (no GPU here); the stores
and the join code are the real ones."""

from __future__ import annotations

import threading
import time

import pytest
import torch.distributed as dist

from mas_async import placement
from mas_async.deployment import free_ports
from mas_async.placement import PlacementError, check_group_gpus
from mas_async.weights.group import open_weight_group
from mas_async.weights.sync import open_receiver, open_sender

pytestmark = pytest.mark.timing  # asserts wall-clock bounds: run one at a time (make test)


def _ranks(target, gpus: list[str]) -> dict[int, object]:
    """Run target(rank, gpu) for every rank in its own thread; rank -> what it returned or raised."""
    out: dict[int, object] = {}

    def run(rank: int) -> None:
        try:
            out[rank] = target(rank, gpus[rank])
        except Exception as e:  # recorded for the test to look at
            out[rank] = e

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(len(gpus))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    return out


def test_nccl_ranks_on_one_gpu_are_refused_by_every_rank() -> None:
    store = dist.HashStore()
    out = _ranks(
        lambda r, gpu: check_group_gpus(store, "vertical", "nccl", r, 3, 5.0, gpu), ["GPU-a", "GPU-b", "GPU-a"]
    )
    for rank in range(3):
        assert isinstance(out[rank], PlacementError)
        assert "ranks 0 and 2 use one GPU" in str(out[rank]) and "rank 1: GPU-b on" in str(out[rank])


def test_nccl_ranks_on_their_own_gpus_pass() -> None:
    store = dist.HashStore()
    assert _ranks(lambda r, gpu: check_group_gpus(store, "v", "nccl", r, 2, 5.0, gpu), ["GPU-a", "GPU-b"]) == {
        0: None, 1: None,
    }  # fmt: skip


def test_a_rank_that_never_reports_ends_the_check_at_its_bound() -> None:
    started = time.monotonic()
    with pytest.raises(PlacementError, match=r"not every rank said which GPU it uses within 0.3s"):
        check_group_gpus(dist.HashStore(), "v", "nccl", 0, 2, 0.3, "GPU-a")
    assert time.monotonic() - started < 1.0


def test_cuda_ipc_servers_must_be_on_the_trainer_s_gpu_and_the_trainer_does_not_wait() -> None:
    store = dist.HashStore()
    check_group_gpus(store, "v", "cuda_ipc", 0, 3, 0.1, "GPU-a")  # returns at once: no server joined yet
    check_group_gpus(store, "v", "cuda_ipc", 1, 3, 5.0, "GPU-a")
    with pytest.raises(
        PlacementError, match=r"rank 2 is not on the trainer's GPU \(rank 0: GPU-a on .*, rank 2: GPU-b"
    ):
        check_group_gpus(store, "v", "cuda_ipc", 2, 3, 5.0, "GPU-b")


def test_gloo_joins_anything() -> None:
    check_group_gpus(dist.HashStore(), "v", "gloo", 0, 2, 0.1, "GPU-a")  # no wait, no key needed


@pytest.fixture
def gpu_per_thread(monkeypatch: pytest.MonkeyPatch) -> threading.local:
    mine = threading.local()
    monkeypatch.setattr(placement, "this_gpu", lambda: mine.gpu)
    return mine


def test_the_nccl_join_names_two_ranks_on_one_gpu_before_nccl_starts(gpu_per_thread: threading.local) -> None:
    ports = free_ports("127.0.0.1", 2)  # one group each (a store lives as long as its failed join's traceback)

    def join(port: int, rank: int, gpu: str) -> object:
        gpu_per_thread.gpu = gpu
        return open_weight_group(policy="vertical", backend="nccl", host="127.0.0.1", port=port, rank=rank,
                                 world_size=2, timeout_s=10)  # fmt: skip

    out = _ranks(lambda rank, gpu: join(ports[0], rank, gpu), ["GPU-a", "GPU-a"])
    assert all(isinstance(out[r], PlacementError) and "ranks 0 and 1 use one GPU" in str(out[r]) for r in (0, 1))
    out = _ranks(lambda rank, gpu: join(ports[1], rank, gpu), ["GPU-a", "GPU-b"])  # past it: no NCCL in CPU torch
    assert all(isinstance(out[r], ValueError) and "needs a torch build with NCCL" in str(out[r]) for r in (0, 1))


def test_a_cuda_ipc_server_on_another_gpu_stops_at_its_join(gpu_per_thread: threading.local) -> None:
    args = {"policy": "vertical", "backend": "cuda_ipc", "host": "127.0.0.1", "port": free_ports("127.0.0.1", 1)[0],
            "world_size": 2, "timeout_s": 10}  # fmt: skip
    gpu_per_thread.gpu = "GPU-a"
    sender = open_sender(**args, share=lambda tensor: {})
    gpu_per_thread.gpu = "GPU-b"
    with pytest.raises(PlacementError, match=r"\(cuda_ipc\) maps the trainer's GPU memory, but rank 1 is not"):
        open_receiver(**args, rank=1, map_handle=lambda handle: None)
    gpu_per_thread.gpu = "GPU-a"
    open_receiver(**args, rank=1, map_handle=lambda handle: None).close()
    sender.close()
