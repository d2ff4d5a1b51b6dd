"""Bounded staleness: the weights of the last k versions, kept so that the rollout log-probs of a sample
generated k versions ago are checked against a recompute under the very weights that generated it."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from mas_async.wire.samples import Sample


class KeptWeights:
    """Copies of a model's flat weight buffers (`flat_params.flatten_parameters`) per version."""

    def __init__(self, flat: list[torch.Tensor], max_staleness: int) -> None:
        self.flat = flat
        self.max_staleness = max_staleness
        self.snapshots: dict[int, list[torch.Tensor]] = {}
        """version -> a copy of the flat buffers of that version (the last k + 1; stale mode only)."""

    def keep(self, version: int) -> None:
        """Keep a copy of the weights now held as `version`; drop those older than k versions."""
        if self.max_staleness == 0:
            return
        self.snapshots[version] = [b.detach().clone() for b in self.flat]
        for old in [v for v in self.snapshots if v < version - self.max_staleness]:
            del self.snapshots[old]

    def check(
        self,
        samples: list[Sample],
        version: int,
        recompute: Callable[[list[Sample]], list[torch.Tensor]],
        limit: int,
    ) -> tuple[list[torch.Tensor], int]:
        """Recompute (`recompute`, with the model over the flat buffers) the log-probs of up to `limit`
        samples of each version older than `version` under that version's kept weights; returns
        |recompute - rollout| per checked sample and the number of samples whose version has no kept
        weights (e.g. generated before a resume). The buffers hold `version` again afterwards."""
        per_version: dict[int, list[Sample]] = {}
        for sample in samples:
            if sample.version != version:
                per_version.setdefault(sample.version, []).append(sample)
        diffs, unchecked = [], 0
        current = self.snapshots.get(version) or [b.detach().clone() for b in self.flat]
        try:
            for old_version, group in sorted(per_version.items()):
                weights = self.snapshots.get(old_version)
                if weights is None:
                    unchecked += len(group)
                    continue
                with torch.no_grad():
                    for buffer, kept in zip(self.flat, weights, strict=True):
                        buffer.copy_(kept)
                    checked = group[:limit]
                    recomputed = recompute(checked)
                for lp, sample in zip(recomputed, checked, strict=True):
                    diffs.append((lp.float().cpu() - torch.from_numpy(np.asarray(sample.logprobs, np.float32))).abs())
        finally:
            with torch.no_grad():
                for buffer, kept in zip(self.flat, current, strict=True):
                    buffer.copy_(kept)
        return diffs, unchecked
