"""The receiving side of the versioned weight broadcast (an inference server's engine).

A receiver mirrors every broadcast of a send (see `mas_async.weights.sender`), into one of two buffer
sets chosen by the caller, so the weights being served are never written to. It always takes part in
every broadcast, even when the manifest does not match what it expects, and raises `ManifestMismatch`
only after the last bucket: the sender and the other receivers never hang.
"""

from __future__ import annotations

import msgpack
import torch

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
        self.group.broadcast(header, "the header of the next version")
        version, manifest_nbytes = (int(x) for x in header.tolist())
        if manifest_nbytes > 0:
            raw = torch.empty(manifest_nbytes, dtype=torch.uint8, device=self.group.device)
            self.group.broadcast(raw, f"the manifest of v{version}")
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
        for index, bucket in enumerate(buckets):
            self.group.broadcast(bucket.view(torch.uint8), f"bucket {index + 1} of {len(buckets)} of v{version}")

        if expected is not None and (entries is not self._checked[0] or expected != self._checked[1]):
            check_manifest(entries, expected)
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
        self._layout = [(parse_dtype(sizes[i][0]), sizes[i][1]) for i in range(len(sizes))]
        self._entries = entries
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
