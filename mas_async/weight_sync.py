"""Versioned weight broadcast from a policy's trainer to its inference servers over torch.distributed.

Each policy has its own group: rank 0 is the trainer's rank 0, ranks 1..R its inference servers.
The group is built without `init_process_group`: rank 0 hosts a TCPStore on (host, port), every rank
wraps it in `PrefixStore("weights/<policy>")` and constructs a ProcessGroupGloo (CPU) or
ProcessGroupNCCL (GPU) object directly. Inside a vLLM worker vLLM owns the default process group, so
this is the only way the same code can run there too.

One `send` is a fixed sequence of broadcasts from rank 0, which every receiver mirrors exactly:
1. header: int64[2] = [version, manifest_nbytes]; manifest_nbytes is 0 when the manifest is the same
   as in the previous send (the layout of a policy's weights does not change from version to version);
2. manifest (only when it changed): uint8[manifest_nbytes], msgpack of
   [[name, shape, dtype, bucket, offset, numel], ...];
3. the buckets, one broadcast each: the tensors flattened into contiguous buffers of one dtype and at
   most `bucket_bytes` each (a larger tensor gets a bucket of its own), sent as raw bytes so any
   dtype travels over any backend. When a bucket's tensors already lie back to back in one storage
   (a trainer's parameters after `flat_params.flatten_parameters`) that region is broadcast as it is,
   with no copy; otherwise they are copied into a bucket buffer kept from one send to the next.
A receiver always takes part in every broadcast of a send, even when the manifest does not match what
it expects, so the sender and the other receivers never hang; it raises `ManifestMismatch` only after
the last bucket, and it never returns a partial set of tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import msgpack
import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")
_LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


class ManifestMismatch(ValueError):
    """The received weights do not have the names, shapes or dtypes the receiver expects."""


@dataclass
class WeightGroup:
    """One rank's handle on a policy's weight-broadcast group. Rank 0 (the trainer) also holds the
    TCPStore server, which must stay alive as long as the group is used."""

    policy: str
    backend: str
    rank: int
    world_size: int
    device: torch.device
    pg: dist.ProcessGroup
    store: dist.Store

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Broadcast `tensor` in place from rank 0 and wait for it."""
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        """Release the communicator (the store server stops when the object is collected)."""
        shutdown = getattr(self.pg, "shutdown", None)
        if shutdown is not None:
            shutdown()


def open_weight_group(
    *,
    policy: str,
    backend: str,
    host: str,
    port: int,
    rank: int,
    world_size: int,
    timeout_s: float = 300,
) -> WeightGroup:
    """Join the weight group of `policy`; blocks until all `world_size` ranks have joined.

    Rank 0 listens on (host, port); the others connect to it, retrying until `timeout_s`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown weight-sync backend {backend!r}; known: {list(BACKENDS)}")
    if world_size < 2 or not 0 <= rank < world_size:
        raise ValueError(f"need world_size >= 2 and 0 <= rank < world_size, got rank {rank} of {world_size}")
    timeout = timedelta(seconds=timeout_s)
    tcp_store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=timeout, wait_for_workers=False)
    store = dist.PrefixStore(f"weights/{policy}", tcp_store)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        # On one machine, pin gloo to loopback rather than whatever the hostname resolves to.
        if host in _LOOPBACK_HOSTS:
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]
        else:
            options._devices = [dist.ProcessGroupGloo.create_default_device()]
        pg = dist.ProcessGroupGloo(store, rank, world_size, options)
        device = torch.device("cpu")
    else:
        if not dist.is_nccl_available():
            raise ValueError("weight-sync backend 'nccl' needs a torch build with NCCL (use 'gloo' on CPU)")
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        pg = dist.ProcessGroupNCCL(store, rank, world_size, options)
        device = torch.device("cuda", torch.cuda.current_device())
    # Keep the TCPStore (rank 0 hosts its server) alive alongside the group.
    return WeightGroup(policy, backend, rank, world_size, device, pg, tcp_store)


def dtype_name(dtype: torch.dtype) -> str:
    """The manifest spelling of a dtype: "float32", "bfloat16", ..."""
    return str(dtype).removeprefix("torch.")


def _parse_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestMismatch(f"unknown dtype {name!r} in the weight manifest")
    return dtype


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


class WeightSender:
    """Rank 0's side: broadcasts a version of the weights to every receiver of the group."""

    def __init__(self, group: WeightGroup, bucket_bytes: int = 64 << 20) -> None:
        if group.rank != 0:
            raise ValueError(f"WeightSender must run on rank 0 of the weight group, not rank {group.rank}")
        if bucket_bytes < 1:
            raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
        self.group = group
        self.bucket_bytes = bucket_bytes
        # Bucket buffers are kept from one send to the next (same layout every version): writing into
        # memory already touched is several times faster than into fresh pages.
        self._buffers: dict[int, torch.Tensor] = {}
        self._sent_manifest = b""
        """The manifest of the previous send (receivers keep it too)."""
        self._signature: list[tuple] = []
        self._plan: _SendPlan | None = None

    def send(self, version: int, named_tensors: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Broadcast `named_tensors` as weight `version`; returns {"seconds", "bytes", "buckets",
        "copied_buckets", "manifest_bytes"} (0 manifest bytes: the manifest was unchanged, not sent)."""
        start = time.perf_counter()
        signature = [(name, t.shape, t.dtype, t.device, t.data_ptr()) for name, t in named_tensors]
        if signature != self._signature:  # the layout (and so the manifest) is the same every version
            self._plan = _SendPlan(named_tensors, self.bucket_bytes, self.group.device)
            self._signature = signature
        plan = self._plan
        changed = plan.manifest != self._sent_manifest
        nbytes = len(plan.manifest) if changed else 0
        self.group.broadcast(torch.tensor([version, nbytes], dtype=torch.int64, device=self.group.device))
        if changed:
            self.group.broadcast(torch.frombuffer(bytearray(plan.manifest), dtype=torch.uint8).to(self.group.device))
            self._sent_manifest = plan.manifest
        total = 0
        for index, (members, region) in enumerate(plan.buckets):
            flat = region
            if flat is None:
                parts = [named_tensors[i][1].detach().reshape(-1).to(self.group.device) for i in members]
                flat = self._bucket_buffer(index, parts)
                torch.cat(parts, out=flat)
            self.group.broadcast(flat.view(torch.uint8))
            total += flat.numel() * flat.element_size()
        return {
            "seconds": time.perf_counter() - start,
            "bytes": float(total),
            "buckets": float(len(plan.buckets)),
            "copied_buckets": float(sum(region is None for _, region in plan.buckets)),
            "manifest_bytes": float(nbytes),
        }

    def _bucket_buffer(self, index: int, parts: list[torch.Tensor]) -> torch.Tensor:
        numel = sum(p.numel() for p in parts)
        flat = self._buffers.get(index)
        if flat is None or flat.dtype != parts[0].dtype or flat.numel() != numel:
            flat = self._buffers[index] = torch.empty(numel, dtype=parts[0].dtype, device=self.group.device)
        return flat


class _SendPlan:
    """How one layout of tensors is sent: the manifest, and per bucket the indices of its tensors and,
    when they lie back to back in one storage on the group's device, the region to broadcast as is."""

    def __init__(self, named_tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int, device: torch.device):
        entries: list[list] = []
        members: list[list[int]] = []
        open_bucket: dict[torch.dtype, tuple[int, int]] = {}  # dtype -> (bucket index, bytes used)
        for i, (name, tensor) in enumerate(named_tensors):
            nbytes = tensor.numel() * tensor.element_size()
            index, used = open_bucket.get(tensor.dtype, (-1, 0))
            if index < 0 or used + nbytes > bucket_bytes:
                index, used = len(members), 0
                members.append([])
            offset = used // tensor.element_size()
            entries.append([name, list(tensor.shape), dtype_name(tensor.dtype), index, offset, tensor.numel()])
            members[index].append(i)
            open_bucket[tensor.dtype] = (index, used + nbytes)
        self.manifest: bytes = msgpack.packb(entries)
        self.buckets: list[tuple[list[int], torch.Tensor | None]] = []
        for indices in members:
            parts = [named_tensors[i][1].detach() for i in indices]
            region = contiguous_region(parts) if parts[0].device == device else None
            self.buckets.append((indices, region))


class WeightReceiver:
    """A receiver's side (ranks 1..R): takes part in each send and returns the tensors."""

    def __init__(self, group: WeightGroup) -> None:
        if group.rank == 0:
            raise ValueError("WeightReceiver cannot run on rank 0, the sender of the weight group")
        self.group = group
        self._buffers: dict[int, list[torch.Tensor]] = {}
        self._entries: list[list] | None = None
        """The manifest of the previous send (a send whose manifest did not change omits it)."""
        self._layout: list[tuple[torch.dtype, int]] = []
        self._views: dict[int, list[tuple[str, torch.Tensor]]] = {}
        """buffer set -> the returned tensors (views of its buckets), kept while the layout holds."""
        self._checked: tuple[list[list] | None, list | None] = (None, None)

    def receive(
        self, expected: list[tuple[str, list[int], str]] | None = None, buffer_set: int = 0
    ) -> tuple[int, list[tuple[str, torch.Tensor]]]:
        """Block until the next send; return (version, [(name, tensor), ...]) in the sender's order.

        With `expected` (e.g. a backend's `parameter_manifest()`), raise ManifestMismatch naming the
        first difference, after every bucket has been received. The returned tensors are views of the
        bucket buffers of `buffer_set`, which the next receive into the same set overwrites (the same
        layout every version): load (copy) them first, or adopt them and receive the next version into
        another set (`flat_params.adopt_parameters`).
        """
        header = torch.zeros(2, dtype=torch.int64, device=self.group.device)
        self.group.broadcast(header)
        version, manifest_nbytes = (int(x) for x in header.tolist())
        if manifest_nbytes > 0:
            raw = torch.empty(manifest_nbytes, dtype=torch.uint8, device=self.group.device)
            self.group.broadcast(raw)
            self._set_manifest(msgpack.unpackb(raw.cpu().numpy().tobytes(), use_list=True))
        elif self._entries is None:
            raise ManifestMismatch("the first send of the group carried no manifest (sender and receiver out of step)")
        entries = self._entries

        buckets = self._buffers.get(buffer_set, [])
        if [(b.dtype, b.numel()) for b in buckets] != self._layout:
            buckets = self._buffers[buffer_set] = [
                torch.empty(n, dtype=dtype, device=self.group.device) for dtype, n in self._layout
            ]
            self._views.pop(buffer_set, None)
        for bucket in buckets:
            self.group.broadcast(bucket.view(torch.uint8))

        if expected is not None and (entries is not self._checked[0] or expected != self._checked[1]):
            _check_manifest(entries, expected)
            self._checked = (entries, expected)  # the same manifest against the same expectation: done
        if buffer_set not in self._views:  # views of the same buffers with the same layout: made once
            self._views[buffer_set] = [
                (name, buckets[index][offset : offset + numel].view(shape))
                for name, shape, _dtype, index, offset, numel in entries
            ]
        return version, list(self._views[buffer_set])

    def _set_manifest(self, entries: list[list]) -> None:
        """A new manifest: each bucket's dtype and length follow from the entries that live in it."""
        sizes: dict[int, tuple[str, int]] = {}
        for _name, _shape, dtype, index, offset, numel in entries:
            sizes[index] = (dtype, max(sizes.get(index, (dtype, 0))[1], offset + numel))
        self._layout = [(_parse_dtype(sizes[i][0]), sizes[i][1]) for i in range(len(sizes))]
        self._entries = entries
        self._views.clear()


def _check_manifest(entries: list[list], expected: list[tuple[str, list[int], str]]) -> None:
    want = {name: (list(shape), dtype) for name, shape, dtype in expected}
    got = {}
    for name, shape, dtype, *_ in entries:
        if name not in want:
            raise ManifestMismatch(f"received tensor {name!r}, which the receiver does not expect")
        if (list(shape), dtype) != want[name]:
            raise ManifestMismatch(
                f"tensor {name!r}: received {dtype}{list(shape)}, expected {want[name][1]}{want[name][0]}"
            )
        got[name] = True
    missing = [name for name in want if name not in got]
    if missing:
        raise ManifestMismatch(f"{len(missing)} expected tensors were not received, first {missing[0]!r}")
