"""Which episode's work goes first when the episodes of an env worker share a limited resource.

Under the on-policy barrier an iteration lasts as long as its slowest episode, so when episodes queue
for something scarce (the sandbox's slots for running programs) the one furthest behind should be
served first: serving in arrival order lets episodes that are ahead take slots the straggler needs.

- `episode_turn`: the turn of the episode whose work is running (a context variable: the episode
  sets it, and the tasks it starts to score its candidates inherit it);
- `PrioritySlots`: an asyncio semaphore that grants a free slot to the waiter with the lowest turn,
  in arrival order among equals.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from contextvars import ContextVar

episode_turn: ContextVar[int] = ContextVar("episode_turn", default=0)


class PrioritySlots:
    """`async with slots:` holds one of `size` slots; waiters are served lowest `episode_turn` first."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"PrioritySlots needs at least one slot, got {size}")
        self.free = size
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    async def acquire(self) -> None:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return
        future = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (episode_turn.get(), next(self._order), future))
        try:
            await future  # the releaser handed its slot over
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # granted just as it was cancelled: pass the slot on
            else:
                self._waiters = [w for w in self._waiters if w[2] is not future]
                heapq.heapify(self._waiters)
            raise

    def release(self) -> None:
        while self._waiters:
            _, _, future = heapq.heappop(self._waiters)
            if not future.done():
                future.set_result(None)  # the slot goes straight to the most urgent waiter
                return
        self.free += 1

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()
