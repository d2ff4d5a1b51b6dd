"""A policy's optimiser: Adam (sharded over the policy's trainer ranks with `trainer.zero`), its
learning-rate schedule, and what a checkpoint and the metrics read of its state."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mas_async.config import TrainerConfig


def make_optimizer(
    parameters: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float, sharded: bool
) -> torch.optim.Optimizer:
    """Adam over `parameters`; `sharded`: its state split over the default process group's ranks
    (`ZeroRedundancyOptimizer`, the same update)."""
    adam = {"lr": lr, "weight_decay": weight_decay}
    if sharded:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(parameters, optimizer_class=torch.optim.Adam, **adam)
    return torch.optim.Adam(parameters, **adam)


def full_state(optimizer: torch.optim.Optimizer, rank: int) -> dict[str, Any] | None:
    """The whole optimiser state to checkpoint: collective when sharded (the shards are consolidated on
    rank 0); None on ranks other than 0."""
    if hasattr(optimizer, "consolidate_state_dict"):
        optimizer.consolidate_state_dict(to=0)
    return optimizer.state_dict() if rank == 0 else None


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimiser state this rank holds (its shard when sharded)."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own optimiser
    return sum(
        t.numel() * t.element_size() for state in local.state.values() for t in state.values()
        if isinstance(t, torch.Tensor)
    )  # fmt: skip


def lr_lambda(trainer: TrainerConfig, total_steps: int) -> Callable[[int], float]:
    """Multiplier of the base lr at optimiser step `step`: linear warm-up, then constant or cosine."""

    def factor(step: int) -> float:
        if trainer.warmup_steps and step < trainer.warmup_steps:
            return (step + 1) / trainer.warmup_steps
        if trainer.lr_schedule == "constant":
            return 1.0
        span = max(1, total_steps - trainer.warmup_steps)
        progress = min(1.0, (step - trainer.warmup_steps) / span)
        return trainer.min_lr_ratio + (1 - trainer.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
