"""Flat parameter buffers and parameter adoption: the zero-copy path of the weight sync.

Sender side (the trainer): `flatten_parameters` makes every parameter of a model a view into one
contiguous buffer per (device, dtype), in `named_parameters()` order, which is the order in which
`WeightSender` packs its buckets. A bucket is then one region of that buffer, and the sender
broadcasts the region itself instead of first copying the tensors into a bucket buffer; the
`headroom` reserved in front of each buffer carries the send's header with its first bucket.

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


def flatten_parameters(named_parameters: Iterable[tuple[str, nn.Parameter]]) -> list[torch.Tensor]:
    """Move the parameters into one contiguous buffer per (device, dtype), in the given order, and make
    each parameter a view of its buffer (values unchanged). Returns the buffers.

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
        room = HEADROOM_BYTES // torch.empty((), dtype=dtype).element_size()
        flat = torch.empty(room + sum(p.numel() for p in members), dtype=dtype, device=device)[room:]
        offset = 0
        with torch.no_grad():
            for p in members:
                view = flat[offset : offset + p.numel()].view(p.shape)
                view.copy_(p.data)
                p.data = view
                offset += p.numel()
        for address in [a for a, first in _first_of_buffer.items() if first() is None]:  # buffers gone
            del _first_of_buffer[address]
        _first_of_buffer[flat.untyped_storage().data_ptr()] = weakref.ref(members[0])
        buffers.append(flat)
    return buffers


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
