"""PrioritySlots: scarce slots go to the episode furthest behind (lowest turn), in arrival order among equals."""

from __future__ import annotations

import asyncio

import pytest

from mas_async.api import PrioritySlots, episode_turn


def test_a_freed_slot_goes_to_the_lowest_turn_then_in_arrival_order() -> None:
    async def scenario() -> list[str]:
        slots = PrioritySlots(1)
        order: list[str] = []
        release = asyncio.Event()

        async def holder() -> None:
            async with slots:
                await release.wait()

        async def waiter(name: str, turn: int) -> None:
            episode_turn.set(turn)  # as an episode does before scoring its candidates
            async with slots:
                order.append(name)

        first = asyncio.create_task(holder())
        await asyncio.sleep(0)
        tasks = [
            asyncio.create_task(waiter(n, t)) for n, t in (("ahead", 3), ("behind-a", 1), ("mid", 2), ("behind-b", 1))
        ]
        await asyncio.sleep(0.01)
        assert order == []  # all wait for the one slot
        release.set()
        await asyncio.gather(first, *tasks)
        assert slots.free == 1
        return order

    assert asyncio.run(scenario()) == ["behind-a", "behind-b", "mid", "ahead"]


def test_a_cancelled_waiter_neither_takes_nor_loses_a_slot() -> None:
    async def scenario() -> None:
        slots = PrioritySlots(1)
        await slots.acquire()
        episode_turn.set(0)
        cancelled = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0)
        episode_turn.set(5)
        later = asyncio.create_task(slots.acquire())
        await asyncio.sleep(0)
        cancelled.cancel()
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        slots.release()  # the slot skips the cancelled waiter
        await asyncio.wait_for(later, 1.0)
        slots.release()
        assert slots.free == 1

    asyncio.run(scenario())


def test_no_slots_is_an_error() -> None:
    with pytest.raises(ValueError, match="at least one slot"):
        PrioritySlots(0)
