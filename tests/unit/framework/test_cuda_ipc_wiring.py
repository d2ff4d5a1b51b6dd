"""The CUDA IPC path wired end to end: `weights.sync` opens the IPC sender and receiver for a policy whose
trainer and servers share a GPU, the Trainer actor sends each version through it, and an hf server
(`ThreadedBackend`) adopts the shared buffers; versions advance by one and the server's log-probs match
the trainer's recompute.

On CPU the IPC handle functions are replaced by an in-process stand-in whose "mapping" is the sender's
very buffer (what CUDA IPC gives another process). The `gpu` tests run the same flow with the real
handles, the server in a child process on the same GPU (skipped without CUDA by tests/conftest.py).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from mas_async.config import Config, load_config
from mas_async.deployment import Deployment
from mas_async.inference.backends.base import make_backend
from mas_async.inference.request import GenerationRequest
from mas_async.training.logprobs import completion_logprobs
from mas_async.training.trainer import Trainer
from mas_async.weights import cuda_ipc
from mas_async.weights.cuda_ipc import CudaIpcReceiver, CudaIpcSender
from mas_async.weights.group import WeightGroupSpec
from mas_async.weights.receiver import WeightReceiver
from mas_async.weights.sender import WeightSender
from mas_async.weights.sync import open_receiver, open_sender
from mas_async.wire.messages import Trained, TrainStep, UpdateWeights
from mas_async.wire.samples import Sample
from tests.support.paths import ROOT

CONFIG = ROOT / "configs" / "plan_path_tiny.yaml"
POLICY = "vertical"
WAIT_S = 60.0


class Registry:
    """share/map stand-ins: a handle names a tensor, and mapping it gives that same memory back."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def share(self, tensor: torch.Tensor) -> dict[str, Any]:
        self.tensors.append(tensor)
        return {"id": len(self.tensors) - 1}

    def map_handle(self, handle: dict[str, Any]) -> torch.Tensor:
        return self.tensors[handle["id"]]


class Worker:
    """A function in a daemon thread; `result` waits a bounded time and re-raises its exception."""

    def __init__(self, name: str, fn: Any) -> None:
        self.box: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, args=(fn,), name=name, daemon=True)
        self.thread.start()

    def _run(self, fn: Any) -> None:
        try:
            self.box["result"] = fn()
        except BaseException as e:
            self.box["error"] = e

    def result(self, timeout: float) -> Any:
        self.thread.join(timeout)
        if self.thread.is_alive():
            raise TimeoutError(f"{self.thread.name}: not done within {timeout:g} s")
        if "error" in self.box:
            raise self.box["error"]
        return self.box.get("result")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _config(model: Path, device: str) -> Config:
    return load_config(CONFIG, [f"policies.{POLICY}.model={model}", f"policies.{POLICY}.device={device}"])


def _deployment(model: Path) -> Deployment:
    ports = {"vertical": _free_port(), "horizontal": _free_port()}
    return Deployment("tcp://127.0.0.1:1", ports, {p: str(model) for p in ports})


PROMPTS = [np.random.default_rng(i).integers(7, 51, size=5 + 3 * i).astype(np.int32) for i in range(4)]


def _generate(backend: Any) -> list[list[Any]]:
    requests = [GenerationRequest(p, n=4, max_tokens=6, temperature=1.0) for p in PROMPTS]
    return asyncio.run(backend.generate(requests))


def _samples(results: list[list[Any]], version: int) -> list[Sample]:
    """One group per prompt, rewards that rank the candidates (non-zero advantages)."""
    return [
        Sample(
            f"e{i}/{POLICY}/0",
            f"e{i}",
            f"p{i}",
            POLICY,
            POLICY,
            0,
            prompt,
            c.token_ids,
            c.logprobs,
            c.version,
            float(j),
        )
        for i, (prompt, group) in enumerate(zip(PROMPTS, results, strict=True))
        for j, c in enumerate(group)
    ]


def _logprob_diff(model: torch.nn.Module, results: list[list[Any]]) -> float:
    pairs = [(p, c) for p, group in zip(PROMPTS, results, strict=True) for c in group]
    with torch.no_grad():
        ours = completion_logprobs(model, [p for p, _ in pairs], [c.token_ids for _, c in pairs], 1.0)
    diffs = [np.abs(o.float().cpu().numpy() - c.logprobs) for o, (_, c) in zip(ours, pairs, strict=True)]
    return float(np.concatenate(diffs).mean())


def _train_and_serve(trainer: Trainer, serve: Any, versions: int, on_update: Any = None) -> list[Trained]:
    """The iteration loop without a router: the server generates with version v, the trainer steps on those
    samples and sends v + 1 (through its sender), the server loads it; checks every version's log-probs.
    `on_update(v)` is called when the trainer announces UpdateWeights(v), as the router would forward it
    (the server's update then runs concurrently with the trainer's send)."""
    sent: list[Any] = []

    def to_router(msg: Any) -> None:  # what would go to the router: UpdateWeights, then Trained
        sent.append(msg)
        if isinstance(msg, UpdateWeights) and on_update is not None:
            on_update(msg.version)

    trainer.send = to_router
    results = serve(0)
    for v in range(versions):
        samples = _samples(results, v)
        trainer.receive(samples, iteration=v)
        asyncio.run(trainer._step(TrainStep(POLICY, v, v, len(samples))))
        assert not sent[-1].error, sent[-1].error
        moved = _logprob_diff(trainer.learner.model, results)  # the step changed the weights...
        results = serve(v + 1)
        assert {c.version for g in results for c in g} == {v + 1}
        diff = _logprob_diff(trainer.learner.model, results)
        assert diff < 1e-4 < moved, (v + 1, diff, moved)  # ...and the server runs exactly the new ones
    trained = [m for m in sent if isinstance(m, Trained)]
    assert [m.version for m in trained] == list(range(1, versions + 1))
    assert all(m.metrics["version_mismatch"] == 0 for m in trained)
    return trained


# --- on CPU: the wiring, with in-process stand-ins for the handles ----------------------------------


def test_the_factory_opens_the_transport_the_backend_names() -> None:
    registry, port = Registry(), _free_port()
    spec = WeightGroupSpec(POLICY, "cuda_ipc", "127.0.0.1", port, world_size=3)
    sender = open_sender(**spec.join_args(0), share=registry.share)
    receivers = [open_receiver(**spec.join_args(r), map_handle=registry.map_handle) for r in (1, 2)]
    assert isinstance(sender, CudaIpcSender) and sender.receivers == 2
    assert all(isinstance(r, CudaIpcReceiver) for r in receivers) and [r.rank for r in receivers] == [1, 2]
    weights = [("w", torch.arange(6.0).view(2, 3))]
    sender.send(4, weights)
    for receiver in receivers:
        version, got = receiver.receive([("w", [2, 3], "float32")])
        assert version == 4 and torch.equal(got[0][1], weights[0][1])
        assert any(got[0][1].data_ptr() == b.data_ptr() for b in sender.sets[0])  # a view, not a copy


def test_the_factory_opens_a_gloo_group_otherwise() -> None:
    spec = WeightGroupSpec(POLICY, "gloo", "127.0.0.1", _free_port(), world_size=2, timeout_s=WAIT_S)
    box: dict[str, Any] = {}
    opener = threading.Thread(target=lambda: box.update(sender=open_sender(**spec.join_args(0))))
    opener.start()
    receiver = open_receiver(**spec.join_args(1))
    opener.join(WAIT_S)
    assert isinstance(box["sender"], WeightSender) and isinstance(receiver, WeightReceiver)
    box["sender"].group.close()
    receiver.group.close()


def test_the_factory_names_what_it_refuses() -> None:
    args = {"policy": POLICY, "host": "127.0.0.1", "port": 1, "world_size": 2}
    with pytest.raises(ValueError, match=r"unknown weight-sync backend 'mpi'; known: \['gloo', 'nccl', 'cuda_ipc'\]"):
        open_sender(backend="mpi", **args)
    with pytest.raises(ValueError, match="sender of a weight group is rank 0"):
        open_sender(backend="cuda_ipc", rank=1, **args)
    with pytest.raises(ValueError, match="rank 1 or more"):
        open_receiver(backend="cuda_ipc", rank=0, **args)


def test_trainer_sends_through_cuda_ipc_and_the_hf_server_adopts(tiny_model, monkeypatch) -> None:
    registry = Registry()
    monkeypatch.setattr(cuda_ipc, "share_tensor", registry.share)
    monkeypatch.setattr(cuda_ipc, "open_tensor", registry.map_handle)
    torch.set_num_threads(1)
    deployment = _deployment(tiny_model)
    trainer = Trainer(_config(tiny_model, "cpu"), deployment, POLICY, ROOT / "runs" / "unused")
    # The same policy on one GPU: the config the actor reads for its weight sync (the learner stays on
    # the CPU here; the stand-in handles are what make CPU memory "shareable").
    trainer.cfg = _config(tiny_model, "cuda")
    trainer.stopping.set()  # main() opens the sender, then returns at once
    asyncio.run(trainer.main())
    assert isinstance(trainer.sender, CudaIpcSender)

    spec = WeightGroupSpec.of(trainer.cfg, deployment, POLICY)
    backend = make_backend("hf", str(tiny_model), dtype="float32", max_batch_sequences=64, seed=0)
    backend.join_weight_group(**spec.join_args(1))
    assert isinstance(backend.receiver, CudaIpcReceiver)
    served: list[list[torch.Tensor]] = []
    updates: dict[int, Any] = {}

    def on_update(version: int) -> None:  # the server's update, in its own thread as in the server
        updates[version] = Worker(f"update v{version}", lambda: backend.update_weights(version))

    def serve(version: int) -> list[list[Any]]:
        if version:
            updates.pop(version).result(WAIT_S)
            params = [p for _, p in backend.engine.model.named_parameters()]
            shared = trainer.sender.sets[(version - 1) % 2]  # send seq = version - 1 went into set seq % 2
            assert all(shared[0].data_ptr() <= p.data_ptr() < shared[0].data_ptr() + shared[0].nbytes for p in params)
            served.append([p.detach().clone() for p in params])
        return _generate(backend)

    trained = _train_and_serve(trainer, serve, versions=3, on_update=on_update)
    assert all(m.metrics["weight_sync_bytes"] > 0 for m in trained)
    # After v3 (set 0), the trainer's own parameters are not what the server serves: a step changes nothing there.
    live = [p for _, p in backend.engine.model.named_parameters()]
    with torch.no_grad():
        for p in trainer.learner.model.parameters():
            p.add_(1.0)
    assert all(torch.equal(a, b) for a, b in zip(live, served[-1], strict=True))


# --- on a GPU: the real handles, the server in a child process ---------------------------------------


def _gpu_server(model: str, spec: WeightGroupSpec, versions: int, out: Any) -> None:
    """A child on the same GPU: an hf server that joins through CUDA IPC and generates with each version."""
    import traceback

    try:
        backend = make_backend("hf", model, dtype="float32", max_batch_sequences=64, seed=1, device="cuda")
        backend.join_weight_group(**spec.join_args(1))
        for version in range(versions + 1):
            if version:
                backend.update_weights(version)
            devices = {str(p.device) for p in backend.engine.model.parameters()}
            results = [[(c.token_ids, c.logprobs, c.version) for c in g] for g in _generate(backend)]
            out.put(("results", version, devices, results))
    except BaseException:
        out.put(("error", traceback.format_exc(), None, None))
        raise


@pytest.mark.gpu
def test_trainer_and_hf_server_on_one_gpu_sync_through_cuda_ipc(tiny_model) -> None:
    from mas_async.wire.samples import Completion

    config, deployment, versions = _config(tiny_model, "cuda"), _deployment(tiny_model), 3
    spec = WeightGroupSpec.of(config, deployment, POLICY)
    assert spec.backend == "cuda_ipc"  # auto: trainer and server share the GPU
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_gpu_server, args=(str(tiny_model), spec, versions, out), daemon=True)
    child.start()
    try:
        trainer = Trainer(config, deployment, POLICY, ROOT / "runs" / "unused")
        trainer.stopping.set()
        asyncio.run(trainer.main())
        assert isinstance(trainer.sender, CudaIpcSender)

        def serve(version: int) -> list[list[Any]]:
            try:
                kind, got, devices, results = out.get(timeout=WAIT_S)
            except queue.Empty:
                raise TimeoutError(f"the server sent nothing for v{version} within {WAIT_S:g} s") from None
            assert kind == "results", got
            assert got == version and devices == {"cuda:0"}
            return [[Completion(ids, lp, v, "length") for ids, lp, v in g] for g in results]

        _train_and_serve(trainer, serve, versions)
        child.join(WAIT_S)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()
            child.join(10)
