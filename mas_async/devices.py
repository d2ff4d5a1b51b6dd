"""The GPU a process works on: checked against the GPUs the process sees, and made its current device.

NCCL groups and CUDA IPC buffers are opened on the current device, so a trainer rank or a server placed on
cuda:N must make cuda:N current before it opens either. The CUDA current device is per thread, and a thread
other than the one that called `use_device` (an `asyncio.to_thread` worker: the step, a gather, a join of
the weight group) starts on cuda:0: the process's blocking calls go to a thread through `to_thread` here,
which makes the process's GPU current there first, and code that names a device reads `process_device`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

import torch

from mas_async.gpu_plan import GPU_SHARE_ENV

_P = ParamSpec("_P")
_T = TypeVar("_T")

_placed: torch.device | None = None
"""The GPU `use_device` made this process's (None: the CPU, or not placed, like a vLLM worker, whose engine
makes its GPU current in the threads it runs)."""


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
    global _placed
    _placed = torch.device("cuda", index)
    return _placed


def process_device() -> torch.device | None:
    """The GPU this process was placed on (`use_device`), whichever thread asks; None when it was not."""
    return _placed


@contextlib.contextmanager
def current(device: torch.device | None) -> Iterator[None]:
    """Make `device` the calling thread's current CUDA device for the block (nothing for None or the CPU;
    "cuda" without an index is cuda:0, as `use_device` takes it)."""
    if device is None or device.type != "cuda":
        yield
        return
    with torch.cuda.device(0 if device.index is None else device.index):
        yield


def on_process_device(func: Callable[_P, _T]) -> Callable[_P, _T]:
    """`func`, run with this process's GPU (`process_device`) current in whichever thread calls it."""

    @functools.wraps(func)
    def run(*args: _P.args, **kwargs: _P.kwargs) -> _T:
        with current(_placed):
            return func(*args, **kwargs)

    return run


async def to_thread(func: Callable[_P, _T], /, *args: _P.args, **kwargs: _P.kwargs) -> _T:
    """`asyncio.to_thread` on this process's GPU: the worker thread makes it current first (a new thread's
    current device is cuda:0, whatever the process was placed on)."""
    return await asyncio.to_thread(on_process_device(func), *args, **kwargs)


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
