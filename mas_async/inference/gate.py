"""The update gate of an inference server: no request is ever served by a mix of two weight versions.

Generation batches are readers, a weight update is the writer; the update waits for the batches in
flight and holds back new ones until the new version is loaded.
"""

from __future__ import annotations

import asyncio


class UpdateGate:
    """A writer-preferring reader/writer gate: generation batches are readers, a weight update is the
    writer. The update waits for the batches in flight; batches that arrive meanwhile wait for it."""

    def __init__(self) -> None:
        self._readers = 0
        self._writing = False
        self._cond = asyncio.Condition()

    async def acquire_read(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing)
            self._readers += 1

    async def release_read(self) -> None:
        async with self._cond:
            self._readers -= 1
            self._cond.notify_all()

    async def acquire_write(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writing)
            self._writing = True
            await self._cond.wait_for(lambda: self._readers == 0)

    async def release_write(self) -> None:
        async with self._cond:
            self._writing = False
            self._cond.notify_all()
