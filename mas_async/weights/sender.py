"""Rank 0's side of the versioned weight broadcast: the trainer sends a version to every replica.

One `send` is a fixed sequence of broadcasts from rank 0, which every receiver mirrors exactly:
1. header: int64[2] = [version, manifest_nbytes]; manifest_nbytes is 0 when the manifest is the same
   as in the previous send (the layout of a policy's weights does not change from version to version).
   When the previous manifest said so (`header_in_first_bucket`), the header is not a broadcast of its
   own: it travels in the HEADROOM_BYTES in front of the first bucket, with that bucket, and a version
   whose manifest did not change is its buckets' broadcasts and nothing else. A changed manifest is
   then announced by a first bucket of the old size that carries only the header;
2. manifest (only when it changed): uint8[manifest_nbytes], msgpack of {"tensors": [[name, shape,
   dtype, bucket, offset, numel], ...], "header_in_first_bucket": bool};
3. the buckets, one broadcast each: the tensors flattened into contiguous buffers of one dtype and at
   most `bucket_bytes` each (a larger tensor gets a bucket of its own), sent as raw bytes so any
   dtype travels over any backend. When tensors already lie back to back in one storage (a trainer's
   parameters after `flat_params.flatten_parameters`) their whole region is one bucket, whatever its
   size, broadcast as it is with no copy (`bucket_bytes` bounds copy buffers; a region needs none, and
   one broadcast of it costs what a raw broadcast of its bytes does); otherwise they are copied into a
   bucket buffer kept from one send to the next. The first bucket carries the header [version, 0] when
   it is a copy buffer or a flat buffer's start (`flat_params.headroom`); a lone tensor there has no
   room in front of it, and the header goes apart.
A receiver always takes part in every broadcast of a send, even when the manifest does not match what
it expects, so the sender and the other receivers never hang; it raises `ManifestMismatch` only after
the last bucket, and it never returns a partial set of tensors.
"""

from __future__ import annotations

import time

import msgpack
import torch

from mas_async.weights.flat_params import HEADROOM_BYTES, contiguous_region, headroom
from mas_async.weights.group import WeightGroup, dtype_name


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
        self._sent: _SendPlan | None = None
        """The plan whose manifest the receivers hold (None before the first send): what they expect first."""
        self._signature: list[tuple] = []
        self._plan: _SendPlan | None = None

    def send(self, version: int, named_tensors: list[tuple[str, torch.Tensor]]) -> dict[str, float]:
        """Broadcast `named_tensors` as weight `version`; returns {"seconds", "bytes", "buckets",
        "copied_buckets", "manifest_bytes", "broadcasts"} (0 manifest bytes: the manifest was unchanged, not
        sent; broadcasts: the buckets, plus the header when it did not travel with the first bucket, plus
        the manifest)."""
        start = time.perf_counter()
        signature = [(name, t.shape, t.dtype, t.device, t.data_ptr()) for name, t in named_tensors]
        if signature != self._signature:  # the layout (and so the manifest) is the same every version
            self._plan = _SendPlan(named_tensors, self.bucket_bytes, self.group.device)
            self._signature = signature
        plan = self._plan
        assert plan is not None
        sent = self._sent
        changed = sent is None or plan.manifest != sent.manifest
        nbytes = len(plan.manifest) if changed else 0
        apart = sent is None or not sent.header_in_first_bucket or changed  # a header broadcast of its own
        if sent is None or not sent.header_in_first_bucket:
            self.group.broadcast(_header(version, nbytes, self.group.device), f"the header of v{version}")
        elif changed:  # the receivers expect the old first bucket, with the header: it carries only that
            carrier = torch.zeros(sent.first_bucket_bytes, dtype=torch.uint8, device=self.group.device)
            carrier[:HEADROOM_BYTES].view(torch.int64).copy_(_header(version, nbytes, self.group.device))
            self.group.broadcast(carrier, f"the header of v{version}")
        if changed:
            manifest = torch.frombuffer(bytearray(plan.manifest), dtype=torch.uint8).to(self.group.device)
            self.group.broadcast(manifest, f"the manifest of v{version}")
            self._sent = plan
        total = 0
        for index, (members, region) in enumerate(plan.buckets):
            flat = region
            if flat is None:
                parts = [named_tensors[i][1].detach().reshape(-1).to(self.group.device) for i in members]
                whole = self._bucket_buffer(index, parts, headroom=index == 0)
                flat = whole[whole.numel() - sum(p.numel() for p in parts) :]
                torch.cat(parts, out=flat)
                wire = whole.view(torch.uint8)
            else:
                wire = plan.first if index == 0 and plan.first is not None else flat.view(torch.uint8)
            if index == 0 and plan.header_in_first_bucket:
                wire[:HEADROOM_BYTES].view(torch.int64).copy_(_header(version, 0, self.group.device))
            self.group.broadcast(wire, f"bucket {index + 1} of {len(plan.buckets)} of v{version}")
            total += flat.numel() * flat.element_size()
        return {
            "seconds": time.perf_counter() - start,
            "bytes": float(total),
            "buckets": float(len(plan.buckets)),
            "copied_buckets": float(sum(region is None for _, region in plan.buckets)),
            "manifest_bytes": float(nbytes),
            "broadcasts": float(len(plan.buckets) + apart + changed),
        }

    def _bucket_buffer(self, index: int, parts: list[torch.Tensor], headroom: bool) -> torch.Tensor:
        """The copy buffer of bucket `index`: room for `parts`, after HEADROOM_BYTES when `headroom`."""
        room = HEADROOM_BYTES // parts[0].element_size() if headroom else 0
        numel = room + sum(p.numel() for p in parts)
        flat = self._buffers.get(index)
        if flat is None or flat.dtype != parts[0].dtype or flat.numel() != numel:
            flat = self._buffers[index] = torch.empty(numel, dtype=parts[0].dtype, device=self.group.device)
        return flat


def _header(version: int, manifest_nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.tensor([version, manifest_nbytes], dtype=torch.int64, device=device)


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
        self.buckets: list[tuple[list[int], torch.Tensor | None]] = []
        for indices in members:
            parts = [named_tensors[i][1].detach() for i in indices]
            region = contiguous_region(parts) if parts[0].device == device else None
            self.buckets.append((indices, region))
        first_region = self.buckets[0][1] if self.buckets else None
        self.first: torch.Tensor | None = headroom(first_region) if first_region is not None else None
        """The first bucket's region with the headroom before it (a flat buffer's start), as uint8."""
        self.header_in_first_bucket = bool(self.buckets) and (first_region is None or self.first is not None)
        """The header travels in front of the first bucket (a copy buffer, or a flat buffer's headroom)."""
        self.first_bucket_bytes = 0
        if self.header_in_first_bucket:
            first = [named_tensors[i][1] for i in members[0]]
            self.first_bucket_bytes = HEADROOM_BYTES + sum(t.numel() * t.element_size() for t in first)
        self.manifest: bytes = msgpack.packb(
            {"tensors": entries, "header_in_first_bucket": self.header_in_first_bucket}
        )
