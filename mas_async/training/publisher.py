"""The trainer's side of the weight sync: each version to every replica of the policy, over the newest
generation of the weight group.

A send is UpdateWeights(version, generation), announced through the router, then the broadcast. The
router orders the group re-formed (`ReformWeightGroup`, router/membership.py) as soon as the policy's
replicas change: without a lost replica (its receivers keep receiving every new version while its
replacement loads), or with a replacement that is ready. The publisher then retires the generation it is
in (a send in progress stops, and so do the replicas waiting in it) and, under the lock that a step also
holds, first sends its current version to the replacements alone (`fresh`, in the generation before the
new one, which only they and the trainer join), then joins the new generation with every member. The
members hold the version last sent to all of them, so nothing is sent to them again unless that send was
cut short. A send that fails because a replica was lost waits for the order that removes it (at most
`trainer.weight_sync_timeout_s`), then goes again in the new generation (docs/faults.md).
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
from mas_async.wire.messages import ReformWeightGroup, UpdateWeights

log = logging.getLogger("mas_async.trainer")

Snapshot = Callable[[], tuple[int, list[tuple[str, torch.Tensor]]]]
"""What to send, read under the publisher's lock: (version, named tensors)."""

NO_SEND = {"seconds": 0.0, "bytes": 0}


class WeightPublisher:
    """Rank 0's sender of a policy's weights, across the generations of its weight group."""

    def __init__(self, spec: WeightGroupSpec, bucket_bytes: int, announce: Callable[[UpdateWeights], None]) -> None:
        self.spec = spec
        self.bucket_bytes = bucket_bytes
        self.announce = announce
        """Sends a message to the router (UpdateWeights before each broadcast)."""
        self.sender: WeightSender | CudaIpcSender | None = None
        """The sender of the generation joined (None before, or while the group has no replica)."""
        self.store: dist.Store | None = None
        """The TCPStore this rank 0 hosts: every generation of the group meets on it (not for cuda_ipc)."""
        self.generation = -1
        """The generation of the group joined (-1: none yet)."""
        self.order = ReformWeightGroup(spec.policy, 0, list(range(spec.world_size - 1)), [])
        """The newest order: at first, the first generation with every replica of the deployment."""
        self._ordered_event = asyncio.Event()
        self.lock = asyncio.Lock()
        """Held by a send (the weights are read) and by the trainer's step (they change)."""
        self._sent: tuple[int, dict[str, float]] | None = None
        """(version, its send's figures) of the version every member of the generation joined holds."""
        self._catch_up: WeightSender | None = None
        """The sender of the last catch-up, kept until the new generation has formed: retired at once, it could
        stop a replacement still reading the send's last bytes; a replacement joins the new generation only once
        it has loaded the version, so then its generation is let go of (its sockets and gloo threads)."""

    @property
    def ordered(self) -> int:
        """The newest generation the router ordered."""
        return self.order.generation

    async def open(self, version: int, snapshot: Snapshot) -> None:
        """Host the store and join the group (the newest generation ordered so far); the replicas of the
        first generation start with `version`, as the trainer does."""
        if self.spec.backend != "cuda_ipc":
            self.store = await asyncio.to_thread(
                open_store, self.spec.host, self.spec.port, self.spec.world_size, is_master=True,
                timeout_s=self.spec.timeout_s,
            )  # fmt: skip
            self._retire_before(self._first(self.order))  # a re-form ordered before the store was up
        self._sent = (version, dict(NO_SEND))
        await self._reform(snapshot)

    def reform(self, order: ReformWeightGroup) -> bool:
        """The router orders generation `order.generation`: retire the older ones (the one joined, or being
        joined). True when the caller must `publish` (catch the replacements up, join, send if need be)."""
        if order.generation <= self.ordered:
            return False
        if self.spec.backend == "cuda_ipc":
            log.error(
                "a re-formed weight group was ordered, but policy %r syncs by CUDA IPC: ignored", self.spec.policy
            )
            return False
        self.order = order
        self._retire_before(self._first(order))
        self._ordered_event.set()
        return True

    async def publish(self, snapshot: Snapshot) -> dict[str, float]:
        """Send the current version (`snapshot()`, read under the lock) to every member of the newest
        generation, unless they hold it already; returns the send's figures."""
        async with self.lock:
            while True:
                await self._reform(snapshot)
                version, tensors = snapshot()
                if self._sent is not None and self._sent[0] == version:
                    return self._sent[1]
                if self.sender is None:  # no replica in the group: the next one to join catches up
                    self._sent = (version, dict(NO_SEND))
                    return self._sent[1]
                self.announce(UpdateWeights(self.spec.policy, version, max(self.generation, 0)))
                try:
                    stats = await asyncio.to_thread(self.sender.send, version, tensors)
                except WeightSyncError as e:
                    if not isinstance(self.sender, WeightSender):
                        raise
                    self.sender.group.retire()  # the replicas still waiting in this generation stop
                    if not (isinstance(e, GroupRetired) and self.ordered > self.generation):
                        log.warning("the send of v%d failed (%s); waiting for the group to be re-formed", version, e)
                        await self._wait_for_order(version, e)
                    continue
                self._sent = (version, stats)
                return stats

    async def _reform(self, snapshot: Snapshot) -> None:
        """Until the newest generation ordered is joined: catch its replacements up, then join it (again, if
        a newer one is ordered meanwhile)."""
        while self.generation < self.ordered:
            order = self.order
            try:
                if order.fresh:
                    await self._send_to_fresh(order, snapshot)
                await self._join(order)
            except GroupRetired:
                continue  # a newer generation was ordered meanwhile
            except WeightSyncError as e:  # a replacement was lost while it caught up: it leaves the next order
                log.warning("the catch-up of %s in generation %d failed (%s)", order.fresh, order.generation - 1, e)
                await self._wait_for_order(snapshot()[0], e, order.generation)

    async def _send_to_fresh(self, order: ReformWeightGroup, snapshot: Snapshot) -> None:
        """Send the current version to the replicas `order.fresh`, alone with them in the generation before
        the new one."""
        args = self.spec.join_args(0, order.generation - 1, world_size=1 + len(order.fresh))
        sender = await asyncio.to_thread(lambda: open_sender(**args, bucket_bytes=self.bucket_bytes, store=self.store))
        assert isinstance(sender, WeightSender)
        self._catch_up = sender
        version, tensors = snapshot()
        self.announce(UpdateWeights(self.spec.policy, version, order.generation - 1))
        await asyncio.to_thread(sender.send, version, tensors)
        log.info("replicas %s of %s caught up to v%d (generation %d)", order.fresh, self.spec.policy, version,
                 order.generation - 1)  # fmt: skip

    async def _join(self, order: ReformWeightGroup) -> None:
        """Join generation `order.generation` with its members (with none, there is no group to join)."""
        if not order.members:
            self.sender = None
        else:
            args = self.spec.join_args(0, order.generation, world_size=1 + len(order.members))
            self.sender = await asyncio.to_thread(
                lambda: open_sender(**args, bucket_bytes=self.bucket_bytes, store=self.store)
            )
        if self._catch_up is not None:  # every replacement has left it (see `_catch_up`)
            self._catch_up.group.retire()
            self._catch_up = None
        self.generation = order.generation
        if order.generation:
            log.info("weight group of %s re-formed (generation %d, replicas %s)", self.spec.policy, order.generation,
                     order.members)  # fmt: skip

    @staticmethod
    def _first(order: ReformWeightGroup) -> int:
        """The first generation an order forms: its catch-up's when it has one."""
        return order.generation - 1 if order.fresh else order.generation

    def _retire_before(self, generation: int) -> None:
        """Retire every generation below `generation` that this rank joined or may have been asked to (the
        replicas still waiting in one give up within POLL_S)."""
        if self.store is None or generation == 0:
            return
        for old in range(max(self.generation, 0), generation):
            retire_generation(self.store, self.spec.policy, old)
        for sender in (self.sender, self._catch_up):
            if isinstance(sender, WeightSender) and sender.group.generation < generation:
                sender.group.retire()
        self._catch_up = None

    async def _wait_for_order(self, version: int, error: Exception, beyond: int | None = None) -> None:
        """Until the router orders a generation newer than `beyond` (the one joined), at most the bound."""
        beyond = self.generation if beyond is None else beyond
        timeout_s = self.spec.timeout_s
        deadline = time.monotonic() + timeout_s
        while self.ordered <= beyond:
            self._ordered_event.clear()
            try:
                await asyncio.wait_for(self._ordered_event.wait(), max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise WeightSyncError(
                    f"policy {self.spec.policy!r}: the send of v{version} failed ({error}) and the router ordered no "
                    f"re-formed weight group within trainer.weight_sync_timeout_s={timeout_s:g}s"
                ) from None
