"""The distributed optimiser (`trainer.distributed_optimizer`): the model in the policy's dtype on every
trainer rank, its float32 master and Adam state sharded over the ranks.

It works as Megatron-LM's distributed optimiser does, on torch.distributed alone (no DDP, no FSDP):

- the trained parameters are views of one flat buffer per dtype (`flat_params.flatten_parameters`, padded
  to a multiple of the N ranks), held in the policy's `dtype` (bf16) and computed in without autocast; their
  gradients are views of a flat gradient buffer of the same layout, into which every backward pass
  accumulates in place (the views are never set to None: `zero_grad` zeroes the buffer);
- rank r owns entries [r*S, (r+1)*S) of each buffer (S = padded length / N): a master shard of them in
  `policies.<p>.master_dtype` (float32) and Adam's state of that shard only (`CountingAdam` over views of
  the shard, `CHUNK_ENTRIES` each, so that Adam's temporaries and the counting copy stay one chunk);
- the step: `clip_gradients` sums the ranks' gradients into each rank's shard (`reduce_scatter_tensor`
  in place; on gloo, which lacks it in older torch, an all-reduce whose shard is then read), casts the
  shard to the master's dtype and clips by the global norm (one all-reduce of the shards' squared norms);
  `step` runs Adam on the master shard and all-gathers the shard, cast to the model's dtype, into the flat
  buffer (`all_gather_into_tensor` in place): the weight sync sends that buffer as it is.

The gradients are summed over the ranks, not averaged as DDP does, so the learner does not scale each rank's
loss by N: every rank's loss is already over the global normaliser, and N ranks make one rank's update on
the union of their samples (up to float rounding; tests/integration/test_distributed_optimizer.py).

Fixed memory per parameter and rank, a bf16 policy over N ranks:

    bf16 weights 2 + bf16 gradients 2 + (float32 master 4 + Adam's two moments 8) / N   bytes

Qwen3-8B (8.19e9 parameters) over 8 ranks: 8.19e9 * (4 + 12 / 8) = 45.0e9 bytes = 41.9 GiB per rank, where
the float32 master whole on every rank takes 137 GiB on one rank (fp32 weights, gradients and Adam, and the
served bf16 copy: 18 bytes), 168 GiB under DDP and 114 GiB with ZeRO-1 over 8 ranks. The step adds the
master-dtype copy of the rank's gradient shard (4 / N: 3.8 GiB), freed when it ends; activations come on
top, so a rank fits in 70 GiB with room for them. `optimizer_state_bytes` counts the master shard and its
Adam state: 12 / N bytes a parameter.

A checkpoint holds one file per rank (`shard_state`, written by every rank into the checkpoint folder,
checkpoint.py) with the world size and the buffers' lengths; `load_shards` reads them back with the same
ranks exactly, or with another number of ranks by taking from each old shard the entries the new one owns.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist

from mas_async.training.optimizer import CHUNK_ENTRIES, CountingAdam


class DistributedOptimizer(CountingAdam):
    """Adam over this rank's master shards of a model's flat parameter buffers (see the module docstring).

    The learner calls `zero_grad` before a step's passes, `clip_gradients` after them (a collective: every
    rank calls it, with or without samples), then `step` (a collective). `param_groups` are Adam's own, so an
    lr scheduler drives it as any optimiser; `last_changes` counts the entries of this rank's shards."""

    def __init__(
        self,
        named_parameters: Iterable[tuple[str, torch.nn.Parameter]],
        buffers: list[torch.Tensor],
        *,
        lr: float,
        weight_decay: float,
        master_dtype: torch.dtype,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        """`buffers`: the parameters' flat buffers, `flatten_parameters(named_parameters, multiple=world_size)`."""
        named = list(named_parameters)
        self.rank, self.world_size = rank, world_size
        if any(buffer.numel() % world_size for buffer in buffers):
            raise ValueError(
                f"flat buffers of {[b.numel() for b in buffers]} entries: not padded to {world_size} shards"
            )
        self.buffers = buffers
        """The model's flat parameter buffers (padded to N equal shards): what the weight sync sends."""
        self.numels = [_parameters_numel(named, buffer) for buffer in self.buffers]
        """The entries of each buffer that are parameters (the rest is padding, always 0)."""
        self.grads = [torch.zeros_like(buffer) for buffer in self.buffers]
        """Each buffer's gradients, in its layout: every parameter's `.grad` is a view of them."""
        for _, p in named:
            i, offset = self._place(p)
            p.grad = self.grads[i][offset : offset + p.numel()].view_as(p)
        self.shard = [buffer.numel() // world_size for buffer in self.buffers]
        self.master = [self._mine(buffer, i).to(master_dtype, copy=True) for i, buffer in enumerate(self.buffers)]
        """This rank's master shard of each buffer, in the master dtype."""
        self.exp_avg = [torch.zeros_like(m) for m in self.master]
        self.exp_avg_sq = [torch.zeros_like(m) for m in self.master]
        self.chunks: list[tuple[int, int, int]] = []
        """(buffer, start, end) of each of Adam's parameters: views of the master shards."""
        params = []
        for i, master in enumerate(self.master):
            for start in range(0, master.numel(), CHUNK_ENTRIES):
                end = min(start + CHUNK_ENTRIES, master.numel())
                params.append(torch.nn.Parameter(master[start:end]))
                self.chunks.append((i, start, end))
        super().__init__(params, lr=lr, weight_decay=weight_decay)
        # Adam's state, made now as views of flat moments (torch makes it at the first step when it is empty):
        # a checkpoint then copies one tensor per buffer, and the memory is held from the start.
        for p, (i, start, end) in zip(params, self.chunks, strict=True):
            self.state[p] = {
                "step": torch.tensor(0.0, dtype=torch.float32),
                "exp_avg": self.exp_avg[i][start:end],
                "exp_avg_sq": self.exp_avg_sq[i][start:end],
            }
        self._reduce_scatter = world_size > 1 and dist.get_backend() != "gloo"
        """Whether the backend reduce-scatters (gloo: an all-reduce, then this rank's shard is read)."""

    def _place(self, p: torch.Tensor) -> tuple[int, int]:
        """(buffer index, entry offset) of parameter `p` in the flat buffers."""
        for i, buffer in enumerate(self.buffers):
            if p.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr():
                return i, p.storage_offset() - buffer.storage_offset()
        raise AssertionError("a trained parameter is in none of the flat buffers")

    def _mine(self, flat: torch.Tensor, i: int) -> torch.Tensor:
        """This rank's shard of buffer `i`'s layout in `flat` (a view)."""
        size = self.shard[i]
        return flat[self.rank * size : (self.rank + 1) * size]

    def master_bytes(self) -> int:
        """Bytes of the master shards (Adam's state is counted from `state`)."""
        return sum(m.numel() * m.element_size() for m in self.master)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers (the parameters' `.grad` stay their views, whatever `set_to_none`)."""
        for grads in self.grads:
            grads.zero_()

    @torch.no_grad()
    def clip_gradients(self, max_norm: float) -> torch.Tensor:
        """Sum every rank's gradients into this rank's shards, in the master dtype, as Adam's gradients, and
        scale them by max_norm / norm where the global norm is above `max_norm` (torch's
        `clip_grad_norm_`'s rule). Returns the global norm before clipping (a tensor: read it once)."""
        shards = []
        for i, grads in enumerate(self.grads):
            mine = self._mine(grads, i)
            if self._reduce_scatter:
                dist.reduce_scatter_tensor(mine, grads)  # in place: the output is the input's own shard
            elif self.world_size > 1:
                dist.all_reduce(grads)
            shards.append(mine.to(self.master[i].dtype))
        squares = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) ** 2 for g in shards]).sum()
        if self.world_size > 1:
            dist.all_reduce(squares)
        norm = squares.sqrt()
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p, (i, start, end) in zip(self._params(), self.chunks, strict=True):
            p.grad = shards[i][start:end]
        for g in shards:
            g.mul_(coef.to(g.device))
        return norm

    def _params(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """Adam on this rank's master shards (of the gradients `clip_gradients` left), counting what changed;
        then every rank's updated shard, cast to the model's dtype, all-gathered into the flat buffers."""
        if closure is not None:
            raise ValueError("DistributedOptimizer.step takes no closure")
        self._counted_step()
        for p in self._params():
            p.grad = None  # the master-dtype gradient shards are freed
        for i, buffer in enumerate(self.buffers):
            mine = self._mine(buffer, i)
            mine.copy_(self.master[i])
            if self.world_size == 1:
                continue
            if self._reduce_scatter:
                dist.all_gather_into_tensor(buffer, mine)  # in place: the input is the output's own shard
            else:
                dist.all_gather(list(buffer.chunk(self.world_size)), mine.clone())

    def shard_state(self) -> dict[str, Any]:
        """This rank's part of a checkpoint, on the host: its master shards, Adam's moments and step of them,
        the hyper-parameters, the world size and the buffers' lengths (`load_shards` reads them back)."""
        return {
            "world_size": self.world_size,
            "rank": self.rank,
            "numels": list(self.numels),
            "master": [m.detach().cpu() for m in self.master],
            "exp_avg": [m.detach().cpu() for m in self.exp_avg],
            "exp_avg_sq": [m.detach().cpu() for m in self.exp_avg_sq],
            "step": float(self.state[self._params()[0]]["step"]),  # (every chunk steps at every step)
            "param_groups": [{k: v for k, v in group.items() if k != "params"} for group in self.param_groups],
        }

    @torch.no_grad()
    def load_shards(self, read: Callable[[int], dict[str, Any]], world_size: int) -> None:
        """Take this rank's shards from a checkpoint's `world_size` files (`read(rank)` gives that rank's
        `shard_state`): with the same ranks its own file, else, from each old shard that holds some, the
        entries this rank owns now. The model's buffers are not touched: the checkpoint's folder holds them
        (the master cast to the model's dtype)."""
        first = read(0)
        self._check(first, world_size)
        for group, saved in zip(self.param_groups, first["param_groups"], strict=True):
            group.update(saved)
        for p in self._params():
            self.state[p]["step"].fill_(first["step"])
        for old_rank in range(world_size):
            state = first if old_rank == 0 else None
            for i, numel in enumerate(self.numels):
                old = -(-numel // world_size) * old_rank  # where the old rank's shard starts
                own = self.rank * self.shard[i]
                lo = max(old, own)
                hi = min(old + -(-numel // world_size), own + self.shard[i], numel)
                if lo >= hi:
                    continue
                if state is None:
                    state = read(old_rank)
                    self._check(state, world_size)
                for key, target in (
                    ("master", self.master),
                    ("exp_avg", self.exp_avg),
                    ("exp_avg_sq", self.exp_avg_sq),
                ):
                    target[i][lo - own : hi - own].copy_(state[key][i][lo - old : hi - old])

    def _check(self, state: dict[str, Any], world_size: int) -> None:
        if state["world_size"] != world_size or state["numels"] != self.numels:
            raise ValueError(
                f"a distributed optimiser shard of {state['world_size']} ranks over buffers of {state['numels']} "
                f"entries, read as one of {world_size} ranks for a model of {self.numels}: another model or run"
            )


def _parameters_numel(named: list[tuple[str, torch.nn.Parameter]], buffer: torch.Tensor) -> int:
    """Entries of `buffer` that its parameters fill (tied parameters once)."""
    storage = buffer.untyped_storage().data_ptr()
    seen = {id(p): p for _, p in named if p.untyped_storage().data_ptr() == storage}
    return sum(p.numel() for p in seen.values())
