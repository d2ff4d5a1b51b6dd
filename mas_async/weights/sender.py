"""Rank 0's side of the versioned weight broadcast: the trainer sends a version to every replica.

One `send` is a fixed sequence of broadcasts from rank 0, which every receiver mirrors exactly:
1. header: int64[2] = [version, manifest_nbytes]; manifest_nbytes is 0 when the manifest is the same
   as in the previous send (the layout of a policy's weights does not change from version to version);
2. manifest (only when it changed): uint8[manifest_nbytes], msgpack of
   [[name, shape, dtype, bucket, offset, numel], ...];
3. the buckets, one broadcast each: the tensors flattened into contiguous buffers of one dtype and at
   most `bucket_bytes` each (a larger tensor gets a bucket of its own), sent as raw bytes so any
   dtype travels over any backend. When tensors already lie back to back in one storage (a trainer's
   parameters after `flat_params.flatten_parameters`) their whole region is one bucket, whatever its
   size, broadcast as it is with no copy (`bucket_bytes` bounds copy buffers; a region needs none, and
   one broadcast of it costs what a raw broadcast of its bytes does); otherwise they are copied into a
   bucket buffer kept from one send to the next.
A receiver always takes part in every broadcast of a send, even when the manifest does not match what
it expects, so the sender and the other receivers never hang; it raises `ManifestMismatch` only after
the last bucket, and it never returns a partial set of tensors.
"""

from __future__ import annotations

import time

import msgpack
import torch

from mas_async.weights.group import WeightGroup, dtype_name


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
        self.group.broadcast(
            torch.tensor([version, nbytes], dtype=torch.int64, device=self.group.device), f"the header of v{version}"
        )
        if changed:
            manifest = torch.frombuffer(bytearray(plan.manifest), dtype=torch.uint8).to(self.group.device)
            self.group.broadcast(manifest, f"the manifest of v{version}")
            self._sent_manifest = plan.manifest
        total = 0
        for index, (members, region) in enumerate(plan.buckets):
            flat = region
            if flat is None:
                parts = [named_tensors[i][1].detach().reshape(-1).to(self.group.device) for i in members]
                flat = self._bucket_buffer(index, parts)
                torch.cat(parts, out=flat)
            self.group.broadcast(flat.view(torch.uint8), f"bucket {index + 1} of {len(plan.buckets)} of v{version}")
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


def _follows(previous: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Does `tensor` start where `previous` ends, in the same storage (both contiguous)?"""
    return (
        tensor.is_contiguous()
        and tensor.untyped_storage().data_ptr() == previous.untyped_storage().data_ptr()
        and tensor.data_ptr() == previous.data_ptr() + previous.numel() * previous.element_size()
    )


class _SendPlan:
    """How one layout of tensors is sent: the manifest, and per bucket the indices of its tensors and,
    when they lie back to back in one storage on the group's device, the region to broadcast as is."""

    def __init__(self, named_tensors: list[tuple[str, torch.Tensor]], bucket_bytes: int, device: torch.device):
        entries: list[list] = []
        members: list[list[int]] = []
        open_bucket: dict[torch.dtype, tuple[int, int]] = {}  # dtype -> (bucket index, bytes used)
        back_to_back: set[int] = set()
        """Buckets whose tensors so far lie back to back in one storage on the group's device."""
        for i, (name, tensor) in enumerate(named_tensors):
            nbytes = tensor.numel() * tensor.element_size()
            index, used = open_bucket.get(tensor.dtype, (-1, 0))
            extends = index in back_to_back and _follows(named_tensors[members[index][-1]][1], tensor)
            if index < 0 or (used + nbytes > bucket_bytes and not extends):
                index, used = len(members), 0
                members.append([])
                if tensor.is_contiguous() and tensor.device == device:
                    back_to_back.add(index)
            elif not extends:
                back_to_back.discard(index)
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
