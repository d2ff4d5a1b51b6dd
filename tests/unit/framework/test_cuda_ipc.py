"""CUDA IPC weight sharing (mas_async/weights/cuda_ipc.py).

On CPU the protocol runs with an in-process stand-in for the IPC handles (the receiver maps the sender's
very buffers, as CUDA IPC does): versions, the alternation of the two buffer sets, the ack that must come
before a set is overwritten, bounded waits and manifest checks. The `gpu` tests run the real handles
between two processes on one device (skipped without CUDA, by tests/conftest.py).
"""

from __future__ import annotations

import socket
import threading
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from mas_async.weights.cuda_ipc import CudaIpcReceiver, CudaIpcSender, WeightSyncTimeout
from mas_async.weights.flat_params import flatten_parameters
from mas_async.weights.group import ManifestMismatch


class Registry:
    """share/map_handle stand-ins: a handle names a tensor, and mapping it gives that same memory back."""

    def __init__(self) -> None:
        self.tensors: list[torch.Tensor] = []

    def share(self, tensor: torch.Tensor) -> dict[str, Any]:
        self.tensors.append(tensor)
        return {"id": len(self.tensors) - 1}

    def map_handle(self, handle: dict[str, Any]) -> torch.Tensor:
        return self.tensors[handle["id"]]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _weights(seed: int) -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [
        ("a", torch.randn(3, 4, generator=g)),
        ("b", torch.randn(5, generator=g).to(torch.bfloat16)),
        ("c", torch.randn(2, 2, generator=g)),
    ]


def _pair(receivers: int = 1, timeout_s: float = 5) -> tuple[CudaIpcSender, list[CudaIpcReceiver], Registry]:
    store, registry = dist.HashStore(), Registry()
    sender = CudaIpcSender(store, receivers, timeout_s=timeout_s, share=registry.share)
    ranks = range(1, 1 + receivers)
    return (
        sender,
        [CudaIpcReceiver(store, r, timeout_s=timeout_s, map_handle=registry.map_handle) for r in ranks],
        registry,
    )


def _manifest(weights: list[tuple[str, torch.Tensor]]) -> list[tuple[str, list[int], str]]:
    return [(n, list(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in weights]


def _equal(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]) -> bool:
    return [n for n, _ in got] == [n for n, _ in want] and all(
        torch.equal(g, w) for (_, g), (_, w) in zip(got, want, strict=True)
    )


def test_versions_alternate_between_two_sets_and_arrive_whole() -> None:
    sender, (receiver,), _ = _pair()
    sent = {v: _weights(v) for v in (1, 2, 3)}
    held: dict[int, list[tuple[str, torch.Tensor]]] = {}
    sets: list[int] = []
    for v in (1, 2, 3):
        # The sender and the receiver run concurrently, as the trainer and the server's update do.
        thread = threading.Thread(target=sender.send, args=(v, sent[v]))
        thread.start()
        version, tensors = receiver.receive(_manifest(sent[v]))
        thread.join(timeout=10)
        assert version == v and _equal(tensors, sent[v])
        ptr = tensors[0][1].data_ptr()
        sets.append(
            next(i for i, s in enumerate(sender.sets) if s[0].data_ptr() <= ptr < s[0].data_ptr() + s[0].nbytes)
        )
        held[v] = tensors
        if v > 1:  # writing v never touched the set that v - 1 was served from
            assert _equal(held[v - 1], sent[v - 1])
    assert sets == [0, 1, 0]


def test_a_set_in_use_is_not_overwritten_before_the_receiver_moves_on() -> None:
    sender, (receiver,), _ = _pair(timeout_s=0.3)
    first, second, third = _weights(1), _weights(2), _weights(3)
    sender.send(1, first)
    _, served = receiver.receive()  # the server now serves set 0
    sender.send(2, second)  # set 1 is free: no wait
    # v3 goes to set 0 again, which the receiver still serves until it starts its next receive.
    with pytest.raises(WeightSyncTimeout, match="acks"):
        sender.send(3, third)
    assert _equal(served, first)  # untouched


def test_every_receiver_must_acknowledge() -> None:
    sender, (one, two), _ = _pair(receivers=2, timeout_s=0.3)
    for v in (1, 2):
        sender.send(v, _weights(v))
        assert one.receive()[0] == v and two.receive()[0] == v
    one.store.set("ack/1/1", b"1")  # receiver 1 has moved on to v2, receiver 2 has not said so
    with pytest.raises(WeightSyncTimeout):
        sender.send(3, _weights(3))
    two.store.set("ack/2/1", b"1")
    sender.send(3, _weights(3))


def test_receiver_wait_is_bounded() -> None:
    _, (receiver,), _ = _pair(timeout_s=0.2)
    with pytest.raises(WeightSyncTimeout, match="receiver 1"):
        receiver.receive()


def test_manifest_mismatch_names_the_tensor() -> None:
    sender, (receiver,), _ = _pair()
    weights = _weights(1)
    sender.send(1, weights)
    expected = _manifest(weights)
    expected[1] = ("b", [6], "bfloat16")
    with pytest.raises(ManifestMismatch, match="'b'"):
        receiver.receive(expected)


def test_layout_is_fixed_by_the_first_send() -> None:
    sender, _, _ = _pair()
    sender.send(1, _weights(1))
    with pytest.raises(ValueError, match="changed"):
        sender.send(2, _weights(2)[:2])


def test_flat_parameters_are_copied_as_one_region_per_buffer() -> None:
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    flatten_parameters(model.named_parameters())
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    sender, (receiver,), registry = _pair()
    stats = sender.send(7, named)
    version, tensors = receiver.receive(_manifest(named))
    assert version == 7 and _equal(tensors, named) and stats["buckets"] == 1
    assert len(registry.tensors) == 2  # one flat buffer per set, shared once
    with torch.no_grad():
        model[0].weight.add_(1.0)  # the trainer's step does not reach the served copy
    assert not torch.equal(tensors[0][1], model[0].weight)


def test_real_store_channel_between_ranks() -> None:
    from mas_async.weights.cuda_ipc import open_ipc_channel

    port, registry = _free_port(), Registry()
    box: dict[str, Any] = {}
    opener = threading.Thread(
        target=lambda: box.update(store=open_ipc_channel(policy="p", host="127.0.0.1", port=port, rank=0, world_size=2))
    )
    opener.start()
    store1 = open_ipc_channel(policy="p", host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=10)
    opener.join(timeout=10)
    sender = CudaIpcSender(box["store"], 1, share=registry.share)
    receiver = CudaIpcReceiver(store1, 1, map_handle=registry.map_handle)
    sender.send(1, _weights(1))
    assert receiver.receive()[0] == 1


# --- on a GPU: the real handles between two processes -----------------------------------------------


def _gpu_receiver(port: int, versions: int, out: Any) -> None:
    """A child process on the same GPU: maps the sender's sets, reports each version's checksum."""
    from mas_async.weights.cuda_ipc import open_ipc_channel

    store = open_ipc_channel(policy="t", host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=60)
    receiver = CudaIpcReceiver(store, 1, timeout_s=60)
    for _ in range(versions):
        version, tensors = receiver.receive()
        out.put((version, [float(t.double().sum()) for _, t in tensors], str(tensors[0][1].device)))


@pytest.mark.gpu
def test_cuda_ipc_between_two_processes() -> None:
    import multiprocessing as mp

    from mas_async.weights.cuda_ipc import open_ipc_channel

    port, versions = _free_port(), 3
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    child = ctx.Process(target=_gpu_receiver, args=(port, versions, out), daemon=True)
    child.start()
    try:
        store = open_ipc_channel(policy="t", host="127.0.0.1", port=port, rank=0, world_size=2, timeout_s=60)
        sender = CudaIpcSender(store, 1, timeout_s=60)
        for v in range(1, 1 + versions):
            weights = [(n, t.cuda()) for n, t in _weights(v)]
            sender.send(v, weights)
            got, sums, device = out.get(timeout=60)
            assert got == v and device.startswith("cuda")
            assert sums == pytest.approx([float(t.double().sum()) for _, t in weights])
        child.join(timeout=60)
        assert child.exitcode == 0
    finally:
        if child.is_alive():
            child.kill()


def test_share_refuses_cpu_tensors() -> None:
    from mas_async.weights.cuda_ipc import share_tensor

    with pytest.raises(ValueError, match="CUDA tensors only"):
        share_tensor(torch.zeros(3))
