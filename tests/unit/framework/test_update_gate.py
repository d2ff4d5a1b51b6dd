"""The inference server's update gate: a weight update waits for the batches in flight, and batches
that arrive meanwhile wait for the update (no request is served by two versions)."""

from __future__ import annotations

import asyncio

from mas_async.inference.gate import UpdateGate


def test_update_waits_for_running_batches_and_holds_new_ones():
    events: list[str] = []

    async def batch(gate: UpdateGate, name: str, hold: asyncio.Event) -> None:
        await gate.acquire_read()
        events.append(f"{name} start")
        await hold.wait()
        events.append(f"{name} end")
        await gate.release_read()

    async def update(gate: UpdateGate) -> None:
        await gate.acquire_write()
        events.append("update start")
        await asyncio.sleep(0.01)
        events.append("update end")
        await gate.release_write()

    async def scenario() -> None:
        gate = UpdateGate()
        first_done = asyncio.Event()
        first = asyncio.create_task(batch(gate, "b1", first_done))
        await asyncio.sleep(0)
        writer = asyncio.create_task(update(gate))
        await asyncio.sleep(0)
        late = asyncio.create_task(batch(gate, "b2", asyncio.Event()))
        late_hold = asyncio.Event()
        late_hold.set()
        await asyncio.sleep(0.01)
        assert events == ["b1 start"]  # the update waits for b1; b2 waits for the update
        first_done.set()
        await writer
        late.cancel()
        second = asyncio.create_task(batch(gate, "b3", late_hold))
        await asyncio.wait_for(asyncio.gather(first, second), 1.0)

    asyncio.run(scenario())
    assert events[:4] == ["b1 start", "b1 end", "update start", "update end"]
    assert events[-2:] == ["b3 start", "b3 end"]
