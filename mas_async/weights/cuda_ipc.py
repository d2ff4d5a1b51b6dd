"""Same-GPU weight sharing through CUDA IPC: a trainer and its inference servers on one device.

NCCL refuses two ranks on one GPU, so when a policy's trainer and its servers share a device the
broadcast of `mas_async.weights.sender` can only go through host memory (gloo). This module shares
device memory instead: the sender owns two buffer sets on the trainer's device (each one flat buffer
per dtype, laid out like the manifest), hands their CUDA IPC handles to every receiver once, and each
version is one device-to-device copy of the trainer's parameters into the set no receiver is serving.
A receiver maps both sets once and returns views of the announced set, which a backend adopts as its
parameters (`flat_params.adopt_parameters`): no bytes move on the receiving side at all.

The control channel is a torch.distributed Store (`open_ipc_channel`: a TCPStore hosted by rank 0, like
the weight group's, under the prefix "weights/<policy>/ipc"); only small msgpack values travel on it:
- "manifest" (once, at the first send): {"entries": [[name, shape, dtype, buffer, offset, numel], ...],
  "sets": [[handle, ...], [handle, ...]]}, one handle per flat buffer of each set;
- "ready/<seq>" (every send, seq = 0, 1, 2, ...): [version, set], written only after the copy into
  `set` (= seq % 2) has completed on the device, so a receiver never sees a half-written buffer;
- "ack/<rank>/<seq>": receiver `rank` has adopted send `seq`'s set and no longer reads the other one.
  A receiver posts it when it starts its next receive (the backend has adopted the previous version
  by then); before it writes send seq >= 2 the sender waits for every receiver's ack of seq - 1, since
  that send overwrites the set of seq - 2. Every wait is bounded (`timeout_s`) and ends in `WeightSyncTimeout`.

Interface: `CudaIpcSender.send(version, named_tensors)` and `CudaIpcReceiver.receive(expected,
buffer_set)` mirror `WeightSender` and `WeightReceiver`, so a backend can take either. The layout of
the weights is fixed by the first send (a policy's never changes), and receivers join before it. The
handle encoding (`share_tensor`, `open_tensor`) is the only CUDA-specific part; the protocol above takes
it as arguments (`share`, `map_handle`), which is how its CPU tests run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import msgpack
import torch
import torch.distributed as dist

from mas_async.placement import check_group_gpus
from mas_async.weights.flat_params import contiguous_region
from mas_async.weights.group import ManifestMismatch, dtype_name, parse_dtype
from mas_async.weights.receiver import check_manifest
from mas_async.weights.store import open_store

Handle = dict[str, Any]
"""A shared buffer as it travels on the control channel (msgpack-able)."""


class WeightSyncTimeout(TimeoutError):
    """A peer of the weight sync did not answer within its bound."""


# --- the CUDA part: a buffer's IPC handle, encoded without pickle ------------------------------------

_STORAGE_CLASSES = {"TypedStorage": torch.storage.TypedStorage, "UntypedStorage": torch.UntypedStorage}


def share_tensor(tensor: torch.Tensor) -> Handle:
    """The CUDA IPC handle of `tensor` (which must stay alive while any receiver maps it), as plain values:
    the fields of `torch.multiprocessing.reductions.reduce_tensor`, without its pickled class objects."""
    if tensor.device.type != "cuda":
        raise ValueError(f"CUDA IPC shares CUDA tensors only, got one on {tensor.device} (on CPU use gloo)")
    from torch.multiprocessing.reductions import reduce_tensor

    _rebuild, args = reduce_tensor(tensor.detach())
    (_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_bytes, storage_offset, _grad,
     ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
    return {
        "shape": list(size), "stride": list(stride), "offset": int(offset), "storage": storage_cls.__name__,
        "dtype": dtype_name(dtype), "device": int(device), "handle": handle, "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset), "ref_handle": ref_handle, "ref_offset": int(ref_offset),
        "event_handle": event_handle, "event_sync": bool(event_sync),
    }  # fmt: skip


def open_tensor(h: Handle) -> torch.Tensor:
    """Map a buffer shared by `share_tensor` in another process (same device) into this one."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    return rebuild_cuda_tensor(
        torch.Tensor, torch.Size(h["shape"]), tuple(h["stride"]), h["offset"], _STORAGE_CLASSES[h["storage"]],
        parse_dtype(h["dtype"]), h["device"], h["handle"], h["storage_bytes"], h["storage_offset"], False,
        h["ref_handle"], h["ref_offset"], h["event_handle"], h["event_sync"],
    )  # fmt: skip


def open_ipc_channel(
    *, policy: str, host: str, port: int, rank: int, world_size: int, timeout_s: float = 60
) -> dist.Store:
    """The control channel of `policy`'s CUDA IPC weight sharing: rank 0 (the trainer) hosts a TCPStore on
    (host, port), ranks 1..world_size-1 (its servers) connect to it, retrying until `timeout_s`, and each
    server checks that it is on the trainer's GPU (`placement.check_group_gpus`)."""
    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(f"need world_size >= 2 and 0 <= rank < world_size, got rank {rank} of {world_size}")
    store = open_store(host, port, world_size, is_master=rank == 0, timeout_s=timeout_s)
    channel = dist.PrefixStore(f"weights/{policy}/ipc", store)  # keeps the TCPStore (and rank 0's server) alive
    # A server on another GPU than the trainer's could not map its buffers: named here, not at the first receive.
    check_group_gpus(channel, policy, "cuda_ipc", rank, world_size, timeout_s)
    return channel


def _wait(store: dist.Store, keys: list[str], timeout_s: float, what: str) -> None:
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
    except RuntimeError as e:  # the store's own timeout error (DistStoreError is a RuntimeError)
        raise WeightSyncTimeout(f"{what}: no answer within {timeout_s:g} s ({e})") from None


# --- the protocol ----------------------------------------------------------------------------------


class CudaIpcSender:
    """The trainer's side: copies each version into the buffer set no receiver serves, then announces it."""

    def __init__(
        self,
        store: dist.Store,
        receivers: int,
        *,
        timeout_s: float = 60,
        share: Callable[[torch.Tensor], Handle] = share_tensor,
    ) -> None:
        if receivers < 1:
            raise ValueError(f"CudaIpcSender needs at least one receiver, got {receivers}")
        self.store = store
        self.receivers = receivers
        self.timeout_s = timeout_s
        self.share = share
        self.seq = 0
        """Sends so far; send `seq` goes into set seq % 2."""
        self.sets: list[list[torch.Tensor]] = []
        """Two buffer sets, each one flat buffer per dtype; owned here for the sender's lifetime (the
        receivers map them)."""
        self._signature: list[tuple] = []
        self._members: list[list[int]] = []
        """buffer -> indices of the named tensors that live in it, in order."""

    def send(self, version: int, named_tensors: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Publish `named_tensors` as weight `version`; returns {"seconds", "wait_seconds", "copy_seconds",
        "bytes", "buckets", "copied_buckets", "manifest_bytes"} like `WeightSender.send` (buckets are the
        flat buffers of a set; wait_seconds is the wait for the receivers' acks)."""
        start = time.perf_counter()
        manifest_bytes = 0
        signature = [(name, tuple(t.shape), t.dtype, t.device) for name, t in named_tensors]
        if not self.sets:
            manifest_bytes = self._setup(named_tensors)
            self._signature = signature
        elif signature != self._signature:
            raise ValueError(
                "CudaIpcSender: the names, shapes, dtypes or device of the weights changed after the first send"
            )
        waited = time.perf_counter()
        if self.seq >= 2:  # the set about to be written is the one of send seq - 2: every receiver has left it
            keys = [f"ack/{rank}/{self.seq - 1}" for rank in range(1, 1 + self.receivers)]
            _wait(self.store, keys, self.timeout_s, f"weights v{version}: the receivers' acks of the previous send")
        copied = time.perf_counter()
        target = self.sets[self.seq % 2]
        for buffer, members in zip(target, self._members, strict=True):
            parts = [named_tensors[i][1].detach() for i in members]
            region = contiguous_region(parts)  # the trainer's flat parameters: one copy per buffer
            if region is not None:
                buffer.copy_(region)
            else:
                torch.cat([p.reshape(-1) for p in parts], out=buffer)
        if target[0].device.type == "cuda":
            torch.cuda.synchronize(target[0].device)  # complete before announced: no half-written reads
        done = time.perf_counter()
        self.store.set(f"ready/{self.seq}", msgpack.packb([version, self.seq % 2]))
        if self.seq >= 2:  # keys nobody reads again: the store stays small
            self.store.delete_key(f"ready/{self.seq - 2}")
            for rank in range(1, 1 + self.receivers):
                self.store.delete_key(f"ack/{rank}/{self.seq - 2}")
        self.seq += 1
        return {
            "seconds": time.perf_counter() - start,
            "wait_seconds": copied - waited,
            "copy_seconds": done - copied,
            "bytes": float(sum(b.numel() * b.element_size() for b in target)),
            "buckets": float(len(target)),
            "copied_buckets": float(len(target)),
            "manifest_bytes": float(manifest_bytes),
        }

    def _setup(self, named_tensors: list[tuple[str, torch.Tensor]]) -> int:
        """Allocate and share the two buffer sets; publish the manifest. Returns its size in bytes."""
        devices = {t.device for _, t in named_tensors}
        if len(devices) != 1:
            raise ValueError(f"CudaIpcSender: the weights must lie on one device, found {sorted(map(str, devices))}")
        entries: list[list] = []
        index: dict[torch.dtype, int] = {}
        sizes: list[int] = []
        for i, (name, tensor) in enumerate(named_tensors):
            b = index.setdefault(tensor.dtype, len(index))
            if b == len(sizes):
                sizes.append(0)
                self._members.append([])
            entries.append([name, list(tensor.shape), dtype_name(tensor.dtype), b, sizes[b], tensor.numel()])
            self._members[b].append(i)
            sizes[b] += tensor.numel()
        (device,) = devices
        dtypes = list(index)
        self.sets = [[torch.empty(n, dtype=d, device=device) for d, n in zip(dtypes, sizes, strict=True)] for _ in "ab"]
        manifest = msgpack.packb({"entries": entries, "sets": [[self.share(b) for b in s] for s in self.sets]})
        self.store.set("manifest", manifest)
        return len(manifest)

    def close(self) -> None:
        """Drop the buffer sets (receivers must have released their mappings: a server is closed first)."""
        self.sets = []


class CudaIpcReceiver:
    """A server's side (ranks 1..R): maps both buffer sets once, returns views of each announced version."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        *,
        timeout_s: float = 60,
        map_handle: Callable[[Handle], torch.Tensor] = open_tensor,
    ) -> None:
        if rank < 1:
            raise ValueError(f"CudaIpcReceiver runs on ranks 1.. of the group, not rank {rank} (the sender's)")
        self.store = store
        self.rank = rank
        self.timeout_s = timeout_s
        self.map_handle = map_handle
        self.seq = 0
        """The next send to receive."""
        self._views: list[list[tuple[str, torch.Tensor]]] = []
        self._entries: list[list] = []
        self._checked: list | None = None

    def receive(
        self, expected: list[tuple[str, list[int], str]] | None = None, buffer_set: int = 0
    ) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Block until the next version is complete; return (version, [(name, tensor), ...]) in the sender's
        order, views of the shared set it was written into. `buffer_set` is ignored (the sender alternates
        the sets). Adopt or copy them before the next receive: that one tells the sender the other set is
        free. With `expected`, raise ManifestMismatch naming the first difference."""
        if self.seq > 0:
            self.store.set(f"ack/{self.rank}/{self.seq - 1}", b"1")
        key = f"ready/{self.seq}"
        _wait(self.store, [key], self.timeout_s, f"receiver {self.rank}: send {self.seq} of the weights")
        version, which = msgpack.unpackb(self.store.get(key))
        if not self._views:
            self._map()
        if expected is not None and expected != self._checked:
            check_manifest(self._entries, expected)
            self._checked = expected
        self.seq += 1
        return version, list(self._views[which])

    def _map(self) -> None:
        manifest = msgpack.unpackb(self.store.get("manifest"))
        self._entries = manifest["entries"]
        for handles in manifest["sets"]:
            buffers = [self.map_handle(h) for h in handles]
            views = []
            for name, shape, dtype, b, offset, numel in self._entries:
                if dtype_name(buffers[b].dtype) != dtype:
                    raise ManifestMismatch(f"tensor {name!r} is {dtype} but its shared buffer holds {buffers[b].dtype}")
                views.append((name, buffers[b][offset : offset + numel].view(shape)))
            self._views.append(views)

    def close(self) -> None:
        """Release the mappings (the caller drops its own references to the returned tensors too)."""
        self._views = []
