"""Opening a policy's weight sync: the sender (trainer) or receiver (server) of the backend it uses.

`WeightGroupSpec.backend` (chosen per policy by `deployment.weight_backend`) names one of two transports
with the same interface, `send(version, named_tensors)` and `receive(expected, buffer_set)`:
- gloo or nccl: a torch.distributed group, `WeightSender` / `WeightReceiver` (a broadcast per bucket);
- cuda_ipc: trainer and servers on one GPU, `CudaIpcSender` / `CudaIpcReceiver` (the servers map the
  trainer's shared buffer sets; a version is one device copy on the trainer's side).
The trainer and every backend open their side here and nowhere else. `share` and `map_handle` replace
the CUDA IPC handle functions (the CPU tests pass in-process stand-ins); None means the real ones.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed

from mas_async.weights import cuda_ipc
from mas_async.weights.cuda_ipc import CudaIpcReceiver, CudaIpcSender, Handle
from mas_async.weights.group import WEIGHT_BACKENDS, open_weight_group
from mas_async.weights.receiver import WeightReceiver
from mas_async.weights.sender import WeightSender

SYNC_BACKENDS = (*WEIGHT_BACKENDS, "cuda_ipc")
TIMEOUT_S = 300.0
"""Bound of joining the group and of every wait of a send or receive (a peer silent for longer is an error)."""


def open_sender(
    *,
    policy: str,
    backend: str,
    host: str,
    port: int,
    world_size: int,
    rank: int = 0,
    bucket_bytes: int = 64 << 20,
    timeout_s: float = TIMEOUT_S,
    generation: int = 0,
    store: torch.distributed.Store | None = None,
    share: Callable[[torch.Tensor], Handle] | None = None,
    join_timeout_s: float | None = None,
) -> WeightSender | CudaIpcSender:
    """Rank 0's side of `policy`'s weight sync (takes `WeightGroupSpec.join_args(0, generation)`). Blocks
    until every rank has joined for gloo and nccl (at most `join_timeout_s`, default `timeout_s`), on the
    TCPStore `store` when rank 0 hosts one already (a re-formed generation); cuda_ipc only hosts its control
    channel (receivers map the buffers at their first receive, so there is no join to wait for) and has no
    generations."""
    _check(backend, rank, expected_rank=0, generation=generation)
    if backend == "cuda_ipc":
        channel = cuda_ipc.open_ipc_channel(
            policy=policy, host=host, port=port, rank=0, world_size=world_size, timeout_s=timeout_s
        )
        return CudaIpcSender(channel, world_size - 1, timeout_s=timeout_s, share=share or cuda_ipc.share_tensor)
    group = open_weight_group(
        policy=policy, backend=backend, host=host, port=port, rank=0, world_size=world_size, timeout_s=timeout_s,
        generation=generation, store=store, join_timeout_s=join_timeout_s,
    )  # fmt: skip
    return WeightSender(group, bucket_bytes=bucket_bytes)


def open_receiver(
    *,
    policy: str,
    backend: str,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float = TIMEOUT_S,
    generation: int = 0,
    map_handle: Callable[[Handle], torch.Tensor] | None = None,
    join_timeout_s: float | None = None,
) -> WeightReceiver | CudaIpcReceiver:
    """Server `rank`'s side (1..world_size-1) of `policy`'s weight sync (takes `join_args(rank, generation)`).
    For gloo and nccl, blocks until every rank has joined (at most `join_timeout_s`, default `timeout_s`)."""
    _check(backend, rank, expected_rank=None, generation=generation)
    if backend == "cuda_ipc":
        channel = cuda_ipc.open_ipc_channel(
            policy=policy, host=host, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s
        )
        return CudaIpcReceiver(channel, rank, timeout_s=timeout_s, map_handle=map_handle or cuda_ipc.open_tensor)
    group = open_weight_group(
        policy=policy, backend=backend, host=host, port=port, rank=rank, world_size=world_size, timeout_s=timeout_s,
        generation=generation, join_timeout_s=join_timeout_s,
    )  # fmt: skip
    return WeightReceiver(group)


def retire_replaced(endpoint: WeightSender | WeightReceiver | CudaIpcSender | CudaIpcReceiver | None) -> None:
    """Give up the generation of a sender or receiver that a newer one replaces (`WeightGroup.retire`:
    its communicator is closed off this thread); cuda_ipc has no generations."""
    if isinstance(endpoint, (WeightSender, WeightReceiver)):
        endpoint.group.retire()


def _check(backend: str, rank: int, expected_rank: int | None, generation: int) -> None:
    if backend not in SYNC_BACKENDS:
        raise ValueError(f"unknown weight-sync backend {backend!r}; known: {list(SYNC_BACKENDS)}")
    if backend == "cuda_ipc" and generation:
        raise ValueError("a cuda_ipc weight sync is not re-formed (a lost replica restarts the run)")
    if expected_rank == 0 and rank != 0:
        raise ValueError(f"the sender of a weight group is rank 0, not rank {rank}")
    if expected_rank is None and rank < 1:
        raise ValueError(f"a receiver of a weight group has rank 1 or more, not {rank}")
