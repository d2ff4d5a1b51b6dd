"""The trainer's side of the weight sync: each version to every replica of the policy, over the newest
generation of the weight group.

A send is UpdateWeights(version, generation), announced through the router, then the broadcast. When the
router replaces a lost replica it orders the group re-formed (`reform`): the publisher retires the
generation it is in (a send in progress stops, and so do the replicas waiting in it), joins the new one
with every replica on the TCPStore it hosts, and sends the current version again. A send that fails
because a replica was lost waits for that order (at most `trainer.weight_sync_timeout_s`), then goes
again in the new generation (docs/faults.md).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from mas_async.weights.cuda_ipc import CudaIpcSender
from mas_async.weights.group import GroupRetired, WeightGroupSpec, WeightSyncError, retire_generation
from mas_async.weights.sender import WeightSender
from mas_async.weights.store import open_store
from mas_async.weights.sync import open_sender
from mas_async.wire.messages import UpdateWeights

log = logging.getLogger("mas_async.trainer")

Snapshot = Callable[[], tuple[int, list[tuple[str, torch.Tensor]]]]
"""What to send, read under the publisher's lock: (version, named tensors)."""


class WeightPublisher:
    """Rank 0's sender of a policy's weights, across the generations of its weight group."""

    def __init__(self, spec: WeightGroupSpec, bucket_bytes: int, announce: Callable[[UpdateWeights], None]) -> None:
        self.spec = spec
        self.bucket_bytes = bucket_bytes
        self.announce = announce
        """Sends a message to the router (UpdateWeights before each broadcast)."""
        self.sender: WeightSender | CudaIpcSender | None = None
        self.store: dist.Store | None = None
        """The TCPStore this rank 0 hosts: every generation of the group meets on it (not for cuda_ipc)."""
        self.generation = -1
        """The generation of the group joined (-1: none yet)."""
        self.ordered = 0
        """The newest generation the router ordered."""
        self._ordered_event = asyncio.Event()
        self.lock = asyncio.Lock()
        """Held by a send (the weights are read) and by the trainer's step (they change)."""
        self._sent: tuple[int, int, dict[str, float]] | None = None
        """(generation, version, its send's figures) of the last send that every replica received."""

    async def open(self, version: int) -> None:
        """Host the store and join the group (the newest generation ordered so far); the replicas of the
        first generation start with `version`."""
        if self.spec.backend != "cuda_ipc":
            self.store = await asyncio.to_thread(
                open_store, self.spec.host, self.spec.port, self.spec.world_size, is_master=True,
                timeout_s=self.spec.timeout_s,
            )  # fmt: skip
            self._retire_before(self.ordered)  # a re-form ordered before the store was up
        await self._join()
        if self.generation == 0:
            self._sent = (0, version, {"seconds": 0.0, "bytes": 0})

    def reform(self, generation: int) -> bool:
        """The router orders generation `generation` (a replica was replaced): retire the older ones (the one
        joined, or being joined). True when the caller must `publish` (join the new one, send again)."""
        if generation <= self.ordered:
            return False
        if self.spec.backend == "cuda_ipc":
            log.error(
                "a re-formed weight group was ordered, but policy %r syncs by CUDA IPC: ignored", self.spec.policy
            )
            return False
        self.ordered = generation
        self._retire_before(generation)
        self._ordered_event.set()
        return True

    async def publish(self, snapshot: Snapshot) -> dict[str, float]:
        """Send the current version (`snapshot()`, read under the lock) to every replica over the newest
        generation, unless it was sent there already; returns the send's figures."""
        async with self.lock:
            while True:
                if self.generation < self.ordered:
                    await self._join()
                version, tensors = snapshot()
                sent = self._sent
                if sent is not None and sent[:2] == (self.generation, version):
                    return sent[2]
                assert self.sender is not None
                self.announce(UpdateWeights(self.spec.policy, version, max(self.generation, 0)))
                try:
                    stats = await asyncio.to_thread(self.sender.send, version, tensors)
                except WeightSyncError as e:
                    if not isinstance(self.sender, WeightSender):
                        raise
                    self.sender.group.retire()  # the replicas still waiting in this generation stop
                    log.warning("the send of v%d failed (%s); waiting for the group to be re-formed", version, e)
                    await self._wait_for_order(version, e)
                    continue
                self._sent = (self.generation, version, stats)
                return stats

    async def _join(self) -> None:
        """Join the newest generation ordered (again, if a newer one is ordered while this one forms)."""
        while self.generation < self.ordered:
            generation = self.ordered
            args = self.spec.join_args(0, generation)
            try:
                self.sender = await asyncio.to_thread(
                    lambda: open_sender(**args, bucket_bytes=self.bucket_bytes, store=self.store)  # noqa: B023 (awaited here)
                )
            except GroupRetired:
                continue  # a newer generation was ordered while this one formed
            self.generation = generation
            if generation:
                log.info("weight group of %s re-formed (generation %d)", self.spec.policy, generation)

    def _retire_before(self, generation: int) -> None:
        if self.store is None or generation == 0:
            return
        for old in range(max(self.generation, 0), generation):
            retire_generation(self.store, self.spec.policy, old)
        if isinstance(self.sender, WeightSender) and self.sender.group.generation < generation:
            self.sender.group.retire()

    async def _wait_for_order(self, version: int, error: Exception) -> None:
        timeout_s = self.spec.timeout_s
        deadline = time.monotonic() + timeout_s
        while self.ordered <= self.generation:
            self._ordered_event.clear()
            try:
                await asyncio.wait_for(self._ordered_event.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise WeightSyncError(
                    f"policy {self.spec.policy!r}: the send of v{version} failed ({error}) and the router ordered no "
                    f"re-formed weight group within trainer.weight_sync_timeout_s={timeout_s:g}s"
                ) from None
