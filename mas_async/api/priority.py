"""Which episode's work goes first when the episodes of an env worker share a limited resource.

Under the on-policy barrier an iteration lasts as long as its slowest episode, so when episodes queue
for something scarce (the sandbox's slots for running programs) the one furthest behind should be
served first: serving in arrival order lets episodes that are ahead take slots the straggler needs.
With bounded staleness the episodes of several iterations run at once, and the oldest iteration's
step waits for its last episode: its episodes go before any of a later iteration, whatever their turn.
A streamed strict step (`trainer.streaming`) computes each problem as soon as its episodes are in, so
there the episodes of an iteration are served in the order they came (`episode_ordinal`): the first ones
finish early and the trainer computes them while the others run, instead of all finishing together at
the end (docs/staleness.md, "Strict streaming").

- `episode_iteration`, `episode_ordinal`, `episode_turn`: the iteration of the episode whose work is
  running, its place among its iteration's episodes (0 for all unless the step is streamed) and its turn
  (context variables: the env worker sets the first two for each episode's task, the episode sets the
  turn, and the tasks it starts to score its candidates inherit them);
- `PrioritySlots`: an asyncio semaphore that grants a free slot to the waiter of the oldest iteration,
  then of the lowest ordinal, then of the lowest turn, in arrival order among equals.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from contextvars import ContextVar

episode_iteration: ContextVar[int] = ContextVar("episode_iteration", default=0)
episode_ordinal: ContextVar[int] = ContextVar("episode_ordinal", default=0)
episode_turn: ContextVar[int] = ContextVar("episode_turn", default=0)


class PrioritySlots:
    """`async with slots:` holds one of `size` slots; waiters are served lowest (`episode_iteration`,
    `episode_ordinal`, `episode_turn`) first."""

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"PrioritySlots needs at least one slot, got {size}")
        self.free = size
        self._waiters: list[tuple[int, int, int, int, asyncio.Future[None]]] = []
        self._order = itertools.count()

    async def acquire(self) -> None:
        if self.free > 0 and not self._waiters:
            self.free -= 1
            return
        future = asyncio.get_running_loop().create_future()
        key = (episode_iteration.get(), episode_ordinal.get(), episode_turn.get(), next(self._order))
        heapq.heappush(self._waiters, (*key, future))
        try:
            await future  # the releaser handed its slot over
        except asyncio.CancelledError:
            if future.done() and not future.cancelled():
                self.release()  # granted just as it was cancelled: pass the slot on
            else:
                self._waiters = [w for w in self._waiters if w[-1] is not future]
                heapq.heapify(self._waiters)
            raise

    def release(self) -> None:
        while self._waiters:
            *_, future = heapq.heappop(self._waiters)
            if not future.done():
                future.set_result(None)  # the slot goes straight to the most urgent waiter
                return
        self.free += 1

    async def __aenter__(self) -> None:
        await self.acquire()

    async def __aexit__(self, *exc: object) -> None:
        self.release()
