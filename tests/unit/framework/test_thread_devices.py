"""The CUDA current device is per thread: a process placed on cuda:N (`device: cuda:N`, pinned
`trainer_devices`) runs its step, its ranks' gather, its weight group's join and its GPU's report in worker
threads, each of which starts on cuda:0. Each of them must work on the process's GPU.

No GPU here: a fake `torch.cuda` keeps the current device per thread as the CUDA runtime does (cudaSetDevice
is per host thread; a new thread starts on device 0), and every call that uses the current device records it.
The trainer's and the server's own code runs on top of it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from mas_async import devices, placement
from mas_async.config import load_config
from mas_async.deployment import Deployment
from mas_async.inference.server import InferenceServer
from mas_async.training.data_parallel import DataParallel
from mas_async.training.trainer import Trainer
from mas_async.weights import group as group_module
from mas_async.wire.messages import TrainStep
from mas_async.wire.samples import Sample
from tests.support.paths import ROOT

PLACED = 2
"""The GPU the process is placed on (a rank >= 1's, or `device: cuda:2`)."""


class ThreadLocalCuda:
    """`torch.cuda` as far as the process's placement uses it, with 4 GPUs: the current device per thread."""

    def __init__(self) -> None:
        self._local = threading.local()

    def current_device(self) -> int:
        return getattr(self._local, "index", 0)

    def set_device(self, device: Any) -> None:
        self._local.index = device.index if isinstance(device, torch.device) else int(device)

    def device(self, index: int) -> Any:
        cuda = self

        class _Device:  # torch.cuda.device: the index current for the block, the previous one after
            def __enter__(self) -> None:
                self.previous = cuda.current_device()
                cuda.set_device(index)

            def __exit__(self, *exc: object) -> None:
                cuda.set_device(self.previous)

        return _Device()

    @staticmethod
    def get_device_properties(device: torch.device) -> Any:
        return SimpleNamespace(uuid=f"GPU-{device.index}")


@pytest.fixture
def cuda(monkeypatch: pytest.MonkeyPatch) -> Iterator[ThreadLocalCuda]:
    """This process placed on cuda:PLACED by `use_device`, in the test's thread, as a trainer or server is."""
    fake = ThreadLocalCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    for name in ("current_device", "set_device", "device", "get_device_properties"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    monkeypatch.setattr(devices, "_placed", None, raising=False)  # (restored: the placement below is the test's)
    devices.use_device(f"cuda:{PLACED}", "the test's process")
    assert fake.current_device() == PLACED  # in this thread only
    yield fake


def _in_a_thread(call: Any) -> Any:
    """`call()` in a new thread (a worker thread of `asyncio.to_thread`), its result back here."""
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.update(result=call()))
    thread.start()
    thread.join()
    return out["result"]


def test_the_weight_group_forms_on_the_process_s_gpu_from_a_worker_thread(cuda: ThreadLocalCuda) -> None:
    assert _in_a_thread(group_module._cuda_device) == torch.device("cuda", PLACED)
    assert _in_a_thread(placement.this_gpu) == f"GPU-{PLACED}"  # what it tells its group's other ranks


def test_the_ranks_gather_runs_on_the_rank_s_gpu_from_a_worker_thread(cuda, monkeypatch) -> None:
    """`all_gather_object` takes no device: on NCCL it stages the objects on the caller's current device."""
    staged_on = []

    def all_gather_object(out: list[Any], obj: Any) -> None:
        staged_on.append(torch.cuda.current_device())
        out[:] = [obj] * len(out)

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    dp = DataParallel.__new__(DataParallel)  # (no group: the gather's collective is the fake's)
    dp.policy, dp.rank, dp.world_size, dp.backend, dp.timeout_s = "vertical", 1, 2, "nccl", 5.0
    dp.device = torch.device("cuda", PLACED)
    assert _in_a_thread(lambda: dp.gather({"loss": 1.0})) == [{"loss": 1.0}] * 2
    assert staged_on == [PLACED]


@pytest.fixture
def setup(tiny_model):
    path = str(tiny_model)
    config = load_config(ROOT / "configs/plan_path_tiny.yaml")
    deployment = Deployment(
        "tcp://127.0.0.1:1", {"vertical": 1, "horizontal": 2}, {"vertical": path, "horizontal": path}
    )
    return config, deployment


def _sample() -> Sample:
    return Sample(
        "e/vertical/0", "e", "p", "vertical", "vertical", 0, np.array([1, 5, 6, 7], dtype=np.int32),
        np.array([20], dtype=np.int32), np.array([-3.9], dtype=np.float32), 0, 0.0,
    )  # fmt: skip


def test_the_trainer_s_step_and_gather_run_on_its_gpu(setup, cuda) -> None:
    """A trainer rank's step from its TrainStep: the learner's step and the ranks' gather, each in a worker
    thread, see the rank's GPU current."""
    _, deployment = setup
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["trainer.streaming=false"])
    trainer = Trainer(config, deployment, "vertical", ROOT / "runs" / "unused", rank=0)
    seen: dict[str, int] = {}

    def step(batch: list[Sample], version: int) -> dict[str, Any]:
        seen["step"] = torch.cuda.current_device()
        return {"samples": len(batch)}

    def gather(metrics: dict[str, Any]) -> list[dict[str, Any]]:
        seen["gather"] = torch.cuda.current_device()
        return [metrics]

    trainer.learner.step = step
    trainer.dp = SimpleNamespace(gather=gather)
    trainer.rank = 1  # (a rank >= 1: no weight send)
    trainer.send = lambda msg: None
    trainer._group_ready.set()
    trainer.receive([_sample()], iteration=0)
    asyncio.run(trainer._step(TrainStep("vertical", 0, 0, 1)))
    assert seen == {"step": PLACED, "gather": PLACED}


def test_the_server_joins_and_receives_its_weights_on_its_gpu(setup, cuda) -> None:
    """An (hf) inference server placed on cuda:N joins its weight group and receives each update in worker
    threads, on its GPU."""
    config, deployment = setup
    config = load_config(ROOT / "configs/plan_path_tiny.yaml", ["policies.vertical.backend=mock"])
    server = InferenceServer(config, deployment, "vertical", 0)
    seen: dict[str, int] = {}

    class Backend:
        version = 0

        def join_weight_group(self, **args: Any) -> None:
            seen["join"] = torch.cuda.current_device()

        def update_weights(self, version: int) -> None:
            seen["update"] = torch.cuda.current_device()
            self.version = version

    server.backend = Backend()
    server.overlap_updates = False
    server.send = lambda msg: None
    asyncio.run(server._join("vertical", 0, 1, 2, 0))
    asyncio.run(server._update("vertical", 1, 0))
    assert seen == {"join": PLACED, "update": PLACED}
