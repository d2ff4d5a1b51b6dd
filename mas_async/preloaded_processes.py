"""Child processes (trainer ranks of a bench or a test, receivers of a weight group) started from a fork server
that has imported torch and the trainer's modules once: each start is a fork of it, not a fresh interpreter
that imports them again (about 4 CPU-seconds a process). The server only imports; it never touches CUDA,
so its children may use CUDA as freshly spawned ones do."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

PRELOAD = ("torch", "mas_async.training.learner", "mas_async.training.data_parallel", "mas_async.weights.group")
"""What the fork server imports before its first fork; a module that fails to import is left to each child."""


def context() -> Any:
    """torch.multiprocessing's forkserver context, its server preloading PRELOAD (set before its first start)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD))
    return ctx


def spawn(fn: Callable[..., None], args: tuple = (), nprocs: int = 1, join: bool = True) -> Any:
    """`torch.multiprocessing.spawn(fn, args, nprocs, join)`, the processes forked from the preloaded server."""
    context()
    return mp.start_processes(fn, args=args, nprocs=nprocs, join=join, start_method="forkserver")
