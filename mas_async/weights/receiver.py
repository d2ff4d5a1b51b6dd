"""The receiving side of the versioned weight broadcast (an inference server's engine).

A receiver mirrors every broadcast of a send (see `mas_async.weights.sender`), into one of two buffer
sets chosen by the caller, so the weights being served are never written to. It always takes part in
every broadcast, even when the manifest does not match what it expects, and raises `ManifestMismatch`
only after the last bucket: the sender and the other receivers never hang.
"""

from __future__ import annotations

import msgpack
import torch

from mas_async.weights.flat_params import HEADROOM_BYTES
from mas_async.weights.group import ManifestMismatch, WeightGroup, parse_dtype


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
        self._header_in_first_bucket = False
        """The sender's header travels in the HEADROOM_BYTES in front of the first bucket (manifest)."""

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
        done = 0  # buckets already received
        if self._entries is not None and self._header_in_first_bucket:
            buckets = self._bucket_set(buffer_set)
            self._broadcast_bucket(buckets, 0, "the first bucket (and header) of the next version")
            version, manifest_nbytes = self._header_of(buckets[0])
            done = 1
        else:
            header = torch.zeros(2, dtype=torch.int64, device=self.group.device)
            self.group.broadcast(header, "the header of the next version")
            version, manifest_nbytes = (int(x) for x in header.tolist())
        if manifest_nbytes > 0:
            raw = torch.empty(manifest_nbytes, dtype=torch.uint8, device=self.group.device)
            self.group.broadcast(raw, f"the manifest of v{version}")
            self._set_manifest(msgpack.unpackb(raw.cpu().numpy().tobytes(), use_list=True))
            done = 0  # a new layout: every bucket follows
        elif self._entries is None:
            raise ManifestMismatch("the first send of the group carried no manifest (sender and receiver out of step)")
        entries = self._entries

        buckets = self._bucket_set(buffer_set)
        for index in range(done, len(buckets)):
            self._broadcast_bucket(buckets, index, f"bucket {index + 1} of {len(buckets)} of v{version}")
        if done == 0 and self._header_in_first_bucket and self._header_of(buckets[0]) != (version, 0):
            raise ManifestMismatch(f"the first bucket of v{version} carried header {self._header_of(buckets[0])}")

        if expected is not None and (entries is not self._checked[0] or expected != self._checked[1]):
            check_manifest(entries, expected)
            self._checked = (entries, expected)  # the same manifest against the same expectation: done
        if buffer_set not in self._views:  # views of the same buffers with the same layout: made once
            self._views[buffer_set] = [
                (name, buckets[index][offset : offset + numel].view(shape))
                for name, shape, _dtype, index, offset, numel in entries
            ]
        return version, list(self._views[buffer_set])

    def _bucket_set(self, buffer_set: int) -> list[torch.Tensor]:
        """The bucket buffers of `buffer_set` in the current layout (each without the first one's headroom;
        made again when the layout changed)."""
        buckets = self._buffers.get(buffer_set, [])
        if [(b.dtype, b.numel()) for b in buckets] != self._layout:
            buckets = self._buffers[buffer_set] = []
            for index, (dtype, n) in enumerate(self._layout):
                room = HEADROOM_BYTES // dtype.itemsize if index == 0 and self._header_in_first_bucket else 0
                buckets.append(torch.empty(room + n, dtype=dtype, device=self.group.device)[room:])
            self._views.pop(buffer_set, None)
        return buckets

    def _broadcast_bucket(self, buckets: list[torch.Tensor], index: int, what: str) -> None:
        bucket = buckets[index]
        if index == 0 and self._header_in_first_bucket:  # with the headroom in front of it
            room = HEADROOM_BYTES // bucket.element_size()
            bucket = bucket.as_strided((room + bucket.numel(),), (1,), bucket.storage_offset() - room)
        self.group.broadcast(bucket.view(torch.uint8), what)

    @staticmethod
    def _header_of(first_bucket: torch.Tensor) -> tuple[int, int]:
        room = HEADROOM_BYTES // first_bucket.element_size()
        whole = first_bucket.as_strided((room,), (1,), first_bucket.storage_offset() - room)
        version, manifest_nbytes = whole.view(torch.uint8).view(torch.int64).tolist()
        return int(version), int(manifest_nbytes)

    def _set_manifest(self, manifest: dict) -> None:
        """A new manifest: each bucket's dtype and length follow from the entries that live in it."""
        entries = manifest["tensors"]
        sizes: dict[int, tuple[str, int]] = {}
        for _name, _shape, dtype, index, offset, numel in entries:
            sizes[index] = (dtype, max(sizes.get(index, (dtype, 0))[1], offset + numel))
        self._layout = [(parse_dtype(sizes[i][0]), sizes[i][1]) for i in range(len(sizes))]
        self._entries = entries
        self._header_in_first_bucket = bool(manifest["header_in_first_bucket"])
        self._buffers.clear()  # made again in the new layout (an engine may still hold the old ones)
        self._views.clear()


def check_manifest(entries: list[list], expected: list[tuple[str, list[int], str]]) -> None:
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
