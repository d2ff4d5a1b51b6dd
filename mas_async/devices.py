"""The GPU a process works on: checked against the GPUs the process sees, and made its current device.

NCCL groups and CUDA IPC buffers are opened on the current device, so a trainer rank or a server placed on
cuda:N must make cuda:N current before it opens either.
"""

from __future__ import annotations

import os

import torch

from mas_async.gpu_plan import GPU_SHARE_ENV


class DeviceError(RuntimeError):
    """A process was placed on a GPU it does not see."""


def use_device(device: str, who: str) -> torch.device:
    """`device` ("cpu", "cuda", "cuda:N") as a torch device; a GPU becomes this process's current device, and
    where the launcher let it share that GPU (`GPU_SHARE_ENV`, `cluster.gpu_shares`) its PyTorch allocator is
    capped at its share of the GPU's memory. A GPU this process does not see raises `DeviceError` naming `who`
    and what it sees."""
    placed = torch.device(device)
    if placed.type != "cuda":
        return placed
    index = 0 if placed.index is None else placed.index
    seen = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if index >= seen:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "unset")
        raise DeviceError(
            f"{who} is placed on cuda:{index}, but this process sees {seen} GPU(s) (CUDA_VISIBLE_DEVICES={visible})"
        )
    torch.cuda.set_device(index)
    share = os.environ.get(GPU_SHARE_ENV)
    if share:
        torch.cuda.set_per_process_memory_fraction(float(share), index)
    return torch.device("cuda", index)


def gpu_id(device: torch.device) -> str:
    """What names the physical GPU behind `device` across processes and nodes (its UUID); "" for the CPU."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


def shared_gpus(ids: list[str]) -> list[tuple[int, int]]:
    """Pairs of ranks (i < j) whose GPU ids in `ids` (rank order, "" for the CPU) are the same GPU."""
    first: dict[str, int] = {}
    pairs = []
    for rank, gpu in enumerate(ids):
        if not gpu:
            continue
        if gpu in first:
            pairs.append((first[gpu], rank))
        else:
            first[gpu] = rank
    return pairs
