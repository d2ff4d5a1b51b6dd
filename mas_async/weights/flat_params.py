"""Flat parameter buffers and parameter adoption: the zero-copy path of the weight sync.

Sender side (the trainer): `flatten_parameters` makes every parameter of a model a view into one
contiguous buffer per (device, dtype), in `named_parameters()` order, which is the order in which
`WeightSender` packs its buckets. A bucket is then one region of that buffer, and the sender
broadcasts the region itself instead of first copying the tensors into a bucket buffer; the
`headroom` reserved in front of each buffer carries the send's header with its first bucket.

When the trainer keeps its weights in another dtype than the servers serve (float32 master weights of a
bf16 policy), what it sends is a `ServedCopy`: the parameters cast into flat buffers of the served dtype
of their own, laid out and registered the same way (the sender's zero-copy regions and headroom work on
them), refreshed after each optimiser step. A CUDA IPC sender copies from it, so it shares buffers in
the served dtype and never the master.

Receiver side (an inference engine): `adopt_parameters` (`ParameterAdopter` version after version)
points each parameter at a received tensor
(a view of the receiver's bucket buffers) instead of copying it in. `ThreadedBackend` receives each
version into the one of two buffer sets the model is not using, so the next broadcast never writes
into the weights being served and a failed broadcast leaves them untouched.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
from torch import nn

from mas_async.weights.group import dtype_name

HEADROOM_BYTES = 16
"""Bytes reserved in front of every flat buffer, for the header of a weight send (`mas_async.weights.sender`)."""
_first_of_buffer: dict[int, weakref.ref] = {}
"""storage address of a flat buffer -> its first parameter (alive: the storage and its headroom are ours)."""


def flatten_parameters(named_parameters: Iterable[tuple[str, nn.Parameter]], multiple: int = 1) -> list[torch.Tensor]:
    """Move the parameters into one contiguous buffer per (device, dtype), in the given order, and make
    each parameter a view of its buffer (values unchanged). Returns the buffers, each padded with zeros
    after its parameters to a multiple of `multiple` entries (the distributed optimiser's N equal shards).

    The parameter objects stay the same (an optimiser's state stays valid); tied parameters move once.
    """
    params: list[nn.Parameter] = []
    seen: set[int] = set()
    for _name, p in named_parameters:
        if id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    groups: dict[tuple[torch.device, torch.dtype], list[nn.Parameter]] = {}
    for p in params:
        groups.setdefault((p.device, p.dtype), []).append(p)
    buffers = []
    for (device, dtype), members in groups.items():
        numel = sum(p.numel() for p in members)
        flat = _flat_buffer(-(-numel // multiple) * multiple, dtype, device)
        offset = 0
        with torch.no_grad():
            flat[numel:].zero_()
            for p in members:
                view = flat[offset : offset + p.numel()].view(p.shape)
                view.copy_(p.data)
                p.data = view
                offset += p.numel()
        _register(flat, members[0])
        buffers.append(flat)
    return buffers


def contiguous_region(parts: list[torch.Tensor]) -> torch.Tensor | None:
    """One flat view covering `parts` when they lie back to back, in order, in a single storage
    (parameters flattened by `flatten_parameters`); None otherwise."""
    first = parts[0]
    storage = first.untyped_storage().data_ptr()
    end = first.data_ptr()
    for p in parts:
        if not p.is_contiguous() or p.dtype != first.dtype or p.untyped_storage().data_ptr() != storage:
            return None
        if p.data_ptr() != end:
            return None
        end += p.numel() * p.element_size()
    numel = sum(p.numel() for p in parts)
    return torch.as_strided(first, (numel,), (1,), first.storage_offset())


def _flat_buffer(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An empty flat buffer of `numel` entries with HEADROOM_BYTES reserved in front of it."""
    room = HEADROOM_BYTES // torch.empty((), dtype=dtype).element_size()
    return torch.empty(room + numel, dtype=dtype, device=device)[room:]


def _register(flat: torch.Tensor, first: torch.Tensor) -> None:
    """Record `flat` (a `_flat_buffer`) as ours while `first`, the tensor at its start, lives (`headroom`)."""
    for address in [a for a, alive in _first_of_buffer.items() if alive() is None]:  # buffers gone
        del _first_of_buffer[address]
    _first_of_buffer[flat.untyped_storage().data_ptr()] = weakref.ref(first)


class ServedCopy:
    """The trained parameters cast to the dtype the servers serve, in flat buffers of their own: one per
    (device, served dtype), in the given order, each with its headroom, as `flatten_parameters` lays out
    the parameters themselves. `named` are views of those buffers; `refresh` casts the parameters' current
    values into them (one copy per run of parameters that lie back to back in one buffer)."""

    def __init__(self, named_parameters: list[tuple[str, torch.Tensor]], dtypes: list[torch.dtype]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, ((_name, p), dtype) in enumerate(zip(named_parameters, dtypes, strict=True)):
            groups.setdefault((p.device, dtype), []).append(i)
        views: dict[int, torch.Tensor] = {}
        self.buffers: list[torch.Tensor] = []
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        """(source, target) pairs `refresh` copies: a run of parameters as one region, or one parameter."""
        for (device, dtype), members in groups.items():
            flat = _flat_buffer(sum(named_parameters[i][1].numel() for i in members), dtype, device)
            offset = 0
            for i in members:
                p = named_parameters[i][1]
                views[i] = flat[offset : offset + p.numel()].view(p.shape)
                offset += p.numel()
            _register(flat, views[members[0]])
            self.buffers.append(flat)
            sources = [named_parameters[i][1].detach() for i in members]
            region = contiguous_region(sources)
            if region is not None:
                self._copies.append((region, flat))
            else:
                self._copies += [(source, views[i]) for source, i in zip(sources, members, strict=True)]
        self.named: list[tuple[str, torch.Tensor]] = [(name, views[i]) for i, (name, _) in enumerate(named_parameters)]
        """(name, view of a served buffer) in the given order: what a weight sync sends."""
        self.refresh()

    def refresh(self) -> None:
        """Cast the parameters' current values into the served buffers."""
        with torch.no_grad():
            for source, target in self._copies:
                target.copy_(source)


def headroom(region: torch.Tensor) -> torch.Tensor | None:
    """The HEADROOM_BYTES reserved right before `region` and the region itself, as one uint8 tensor (a
    sender writes its header there and broadcasts both at once, with no copy), when `region` starts a
    flat buffer of `flatten_parameters` whose first parameter still lives in it; None otherwise."""
    storage = region.untyped_storage()
    first = _first_of_buffer.get(storage.data_ptr(), lambda: None)()
    if (
        first is None
        or first.data_ptr() != region.data_ptr()
        or first.untyped_storage().data_ptr() != storage.data_ptr()
    ):
        return None
    if region.storage_offset() * region.element_size() != HEADROOM_BYTES:  # not where flatten_parameters put it
        return None
    whole = torch.empty(0, dtype=torch.uint8, device=region.device)
    return whole.set_(storage, 0, (HEADROOM_BYTES + region.numel() * region.element_size(),), (1,))


def check_named_tensors(params: dict[str, nn.Parameter], named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Raise a ValueError naming the first parameter that is unknown, repeated, missing, or of another
    shape or dtype. Nothing is touched before this passes."""
    seen: set[str] = set()
    for name, tensor in named_tensors:
        if name not in params:
            raise ValueError(f"load_weights: unknown parameter {name!r}")
        if name in seen:
            raise ValueError(f"load_weights: parameter {name!r} given twice")
        seen.add(name)
        expected = params[name]
        if tuple(tensor.shape) != tuple(expected.shape) or tensor.dtype != expected.dtype:
            raise ValueError(
                f"load_weights: parameter {name!r} is {dtype_name(tensor.dtype)}{list(tensor.shape)}, "
                f"the model has {dtype_name(expected.dtype)}{list(expected.shape)}"
            )
    missing = [name for name in params if name not in seen]
    if missing:
        raise ValueError(f"load_weights: {len(missing)} parameters missing, first {missing[0]!r}")


def adopt_parameters(params: dict[str, nn.Parameter], named_tensors: list[tuple[str, torch.Tensor]]) -> None:
    """Make each parameter a view of its received tensor (no copy), after checking every name, shape
    and dtype. A tensor on another device than its parameter is copied over instead."""
    ParameterAdopter(params).adopt(named_tensors)


class ParameterAdopter:
    """`adopt_parameters` for one engine, version after version. A receiver hands out the same views of a
    buffer set every version (`WeightReceiver.receive`), so a list of the very (name, tensor) pairs
    checked before is not checked again; the last `keep` lists are remembered (two buffer sets)."""

    def __init__(self, params: dict[str, nn.Parameter], keep: int = 2) -> None:
        self.params = params
        self.keep = keep
        self._checked: list[list[tuple[str, torch.Tensor]]] = []

    def adopt(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        if not any(_same_pairs(checked, named_tensors) for checked in self._checked):
            check_named_tensors(self.params, named_tensors)
            self._checked = [*self._checked, list(named_tensors)][-self.keep :]
        with torch.no_grad():
            for name, tensor in named_tensors:
                param = self.params[name]
                param.data = tensor if tensor.device == param.device else tensor.to(param.device)


def _same_pairs(a: list[tuple[str, torch.Tensor]], b: list[tuple[str, torch.Tensor]]) -> bool:
    """The same pair objects in the same order (a remembered list holds them, so no id is reused)."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b, strict=True))
