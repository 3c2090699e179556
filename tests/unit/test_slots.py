"""Call slots: the bound on attempts in their step, interactive first, cancellation safe."""

from __future__ import annotations

import asyncio

import pytest

from calmq.processors.slots import CallSlots, queue_room


async def _started(slots: CallSlots, priority: str, log: list[str], name: str) -> None:
    await slots.acquire(priority)
    log.append(name)


def test_no_more_than_size_hold_a_slot_and_a_release_lets_the_next_in() -> None:
    async def scenario() -> None:
        slots = CallSlots(2)
        log: list[str] = []
        tasks = [asyncio.create_task(_started(slots, "bulk", log, f"b{i}")) for i in range(3)]
        await asyncio.sleep(0)
        assert log == ["b0", "b1"]
        assert slots.used == 2
        slots.release()
        await asyncio.sleep(0)
        assert log == ["b0", "b1", "b2"]
        assert slots.used == 2
        await asyncio.gather(*tasks)

    asyncio.run(scenario())


def test_interactive_waiters_go_before_bulk_and_may_use_the_reserve() -> None:
    async def scenario() -> None:
        slots = CallSlots(1, reserve=1)
        log: list[str] = []
        await slots.acquire("bulk")
        bulk = asyncio.create_task(_started(slots, "bulk", log, "bulk"))
        await asyncio.sleep(0)
        first = asyncio.create_task(_started(slots, "interactive", log, "i1"))
        second = asyncio.create_task(_started(slots, "interactive", log, "i2"))
        await asyncio.sleep(0)
        assert log == ["i1"]  # the reserve: beyond the bound, bulk still waits
        slots.release()
        await asyncio.sleep(0)
        assert log == ["i1", "i2"]  # the freed slot went to interactive, not to bulk
        slots.release()
        slots.release()
        await asyncio.sleep(0)
        assert log == ["i1", "i2", "bulk"]
        await asyncio.gather(bulk, first, second)

    asyncio.run(scenario())


def test_a_cancelled_waiter_leaves_no_slot_taken() -> None:
    async def scenario() -> None:
        slots = CallSlots(1)
        await slots.acquire("bulk")
        waiter = asyncio.create_task(slots.acquire("bulk"))
        await asyncio.sleep(0)
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        slots.release()
        assert slots.used == 0
        await slots.acquire("bulk")
        assert slots.used == 1

    asyncio.run(scenario())


def test_a_waiter_cancelled_after_its_grant_hands_the_slot_back() -> None:
    async def scenario() -> None:
        slots = CallSlots(1)
        await slots.acquire("bulk")
        waiter = asyncio.create_task(slots.acquire("bulk"))
        await asyncio.sleep(0)
        slots.release()  # granted to the waiter...
        waiter.cancel()  # ...which is cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await waiter
        assert slots.used == 0

    asyncio.run(scenario())


def test_bulk_held_past_the_bound_leaves_the_interactive_reserve_whole() -> None:
    # The bound shrank under 40 bulk jobs claimed before (the token budget): bulk has no
    # room, interactive still has its reserve of 8.
    assert queue_room("bulk", 32, 8, held=40, interactive=0) == -8
    assert queue_room("interactive", 32, 8, held=40, interactive=0) == 8
    assert queue_room("interactive", 32, 8, held=45, interactive=5) == 3


def test_interactive_takes_what_bulk_leaves_of_the_bound_then_the_reserve() -> None:
    assert queue_room("interactive", 32, 8, held=20, interactive=0) == 20
    assert queue_room("interactive", 32, 8, held=40, interactive=30) == 0
    assert queue_room("bulk", 32, 8, held=20, interactive=10) == 12
