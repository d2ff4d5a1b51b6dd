"""Wave gathering: when a server that runs one batch at a time takes its queue as the next batch."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mas_async.wire.messages import Generate


class WaveGather:
    """When a server that runs one batch at a time (hf, mock) takes its queue as the next batch.

    Episodes answer a batch together and send their next prompts together: a wave. A request that
    misses the batch of its wave waits a whole batch, so the server waits while requests keep arriving
    less than `gap_s` apart, never beyond `capacity` sequences. The wave that follows a batch is
    expected to hold as many requests as that batch did; until it does, the allowed gap grows to
    `fraction` of that batch's duration (waiting then costs at most that fraction of a batch). The
    whole wait is never longer than the last batch took, or 20 short gaps before there was one.
    """

    def __init__(self, gap_s: float, fraction: float, capacity: int) -> None:
        self.gap_s = gap_s
        self.fraction = fraction
        self.capacity = capacity
        self.last_requests = 0
        self.last_seconds = 0.0
        self._arrived = asyncio.Event()

    def arrived(self) -> None:
        """A request was queued."""
        self._arrived.set()

    def batch_done(self, requests: int, seconds: float) -> None:
        self.last_requests, self.last_seconds = requests, seconds

    async def wait(self, queue: list[Generate]) -> None:
        """Return when `queue` should be taken as a batch."""
        loop = asyncio.get_running_loop()
        start = last_arrival = loop.time()
        long_gap = max(self.gap_s, self.fraction * self.last_seconds)
        give_up = start + max(self.last_seconds, 20 * self.gap_s)
        seen = len(queue)
        while sum(r.n for r in queue) < self.capacity:
            now = loop.time()
            if len(queue) != seen:
                seen, last_arrival = len(queue), now
            gap = long_gap if seen < self.last_requests else self.gap_s
            wait = min(last_arrival + gap, give_up) - now
            if wait <= 0:
                return
            self._arrived.clear()
            try:
                await asyncio.wait_for(self._arrived.wait(), wait)
            except TimeoutError:
                pass
