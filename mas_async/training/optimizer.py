"""A policy's optimiser: Adam (its state sharded over the policy's trainer ranks with `trainer.zero`; with
`trainer.distributed_optimizer` the master too: distributed_optimizer.py), its learning-rate schedule, and
what a checkpoint and the metrics read of its state.

The Adam here counts what each step changed (`CountingAdam`): the trainer's `changed_fraction`, which
shows a step that moved nothing (an update below half a ulp of the dtype the weights are kept in) as ~0
while every other metric looks healthy."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

from mas_async.config import TrainerConfig

CHUNK_ENTRIES = 1 << 24
"""Parameter entries `CountingAdam` steps and compares at a time (64 MiB of float32): the copy it compares
against is one chunk (or one parameter larger than that), never a second copy of the model."""


class CountingAdam(torch.optim.Adam):
    """torch's Adam, stepped a chunk of parameters at a time (`CHUNK_ENTRIES`), each chunk compared with a
    copy of itself taken just before: `last_changes` is (entries the step changed, entries held), or None
    before a step. Adam's update of an entry depends on that entry alone, so stepping in chunks gives the
    very numbers of one step over every parameter (the same kernels, applied to fewer tensors at a time).
    A parameter without a gradient is held but not stepped: it counts as unchanged."""

    def __init__(self, params: Iterable[torch.nn.Parameter], **kwargs: Any) -> None:
        super().__init__(params, **kwargs)
        self.last_changes: tuple[int, int] | None = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        if closure is not None:
            raise ValueError("CountingAdam.step takes no closure")
        self._counted_step()

    def _counted_step(self) -> None:
        """The step, chunk by chunk, counting the changes (without the hooks torch wraps `step` in: a
        subclass's own `step` runs them once around it)."""
        groups = self.param_groups
        changed = held = 0
        try:
            for group in groups:
                held += sum(p.numel() for p in group["params"])
                for chunk in _chunks([p for p in group["params"] if p.grad is not None], CHUNK_ENTRIES):
                    before = [p.detach().clone() for p in chunk]
                    self.param_groups = [{**group, "params": chunk}]
                    _adam_step()(self)
                    changed += sum(int(torch.ne(p, b).sum()) for p, b in zip(chunk, before, strict=True))
                    del before
        finally:
            self.param_groups = groups
        self.last_changes = (changed, held)


def _adam_step() -> Callable[[torch.optim.Adam], Any]:
    """Adam's own step without the wrapper torch puts around a class's `step` once an instance of it exists
    (it runs the optimiser's step hooks): the chunks are parts of one step, whose hooks run once, around
    `CountingAdam.step`."""
    step = torch.optim.Adam.step
    return step.__wrapped__ if getattr(step, "hooked", False) else step


def _chunks(params: list[torch.Tensor], entries: int) -> list[list[torch.Tensor]]:
    """`params` in order, cut into runs of at most `entries` entries (a larger parameter alone)."""
    out: list[list[torch.Tensor]] = []
    size = entries
    for p in params:
        if size + p.numel() > entries:
            out.append([])
            size = 0
        out[-1].append(p)
        size += p.numel()
    return out


def make_optimizer(
    parameters: Iterable[torch.nn.Parameter], *, lr: float, weight_decay: float, sharded: bool
) -> torch.optim.Optimizer:
    """Adam (`CountingAdam`) over `parameters`; `sharded`: its state split over the default process group's
    ranks (`ZeroRedundancyOptimizer`, the same update; each rank counts the changes of its own shard)."""
    adam = {"lr": lr, "weight_decay": weight_decay}
    if sharded:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(parameters, optimizer_class=CountingAdam, **adam)
    return CountingAdam(parameters, **adam)


def step_changes(optimizer: torch.optim.Optimizer) -> tuple[int, int] | None:
    """(entries changed, entries held) by this rank's last step of `optimizer` (its shard when sharded), or
    None when no step ran since `forget_changes` (a step skipped by loss scaling)."""
    return getattr(optimizer, "optim", optimizer).last_changes


def forget_changes(optimizer: torch.optim.Optimizer) -> None:
    getattr(optimizer, "optim", optimizer).last_changes = None


def full_state(optimizer: torch.optim.Optimizer, rank: int) -> dict[str, Any] | None:
    """The whole optimiser state to checkpoint: collective when sharded (the shards are consolidated on
    rank 0); None on ranks other than 0."""
    if hasattr(optimizer, "consolidate_state_dict"):
        optimizer.consolidate_state_dict(to=0)
    return optimizer.state_dict() if rank == 0 else None


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of optimiser state this rank holds (its shard when sharded): Adam's, and the distributed
    optimiser's master shard (`DistributedOptimizer.master_bytes`; its model holds the served dtype only)."""
    local = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer's own optimiser
    master = local.master_bytes() if hasattr(local, "master_bytes") else 0
    return master + sum(
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
