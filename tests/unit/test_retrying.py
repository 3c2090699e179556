"""The kernel's retry loop: jittered pauses that grow, stay jittered at the cap, and count."""

from __future__ import annotations

import asyncio
import random

import pytest
from prometheus_client import REGISTRY

from calmq.retrying import Backoff, Reconnect, retry_forever

FAST = Backoff(initial=0.001, maximum=0.004)


def _retries(what: str) -> float:
    return REGISTRY.get_sample_value("calmq_operation_retries_total", {"what": what}) or 0.0


def test_pauses_grow_then_stay_spread_over_the_top_band() -> None:
    """Pauses grow with each failure; at the cap they keep spreading over the last band
    below the maximum (here [3.2, 5] s), never one fixed value."""
    state = Reconnect("test: growing pauses", Backoff(initial=0.1, maximum=5.0),
                      rng=random.Random(3))
    first = [state.failed() for _ in range(6)]
    assert first == sorted(first)
    capped = [state.failed() for _ in range(200)]
    assert all(3.2 <= d <= 5.0 for d in capped)
    assert max(capped) - min(capped) > 1.5  # not one value: the fleet does not move in step


def test_success_starts_the_next_outage_from_the_shortest_pause() -> None:
    """After succeeded(), the next failure waits within the first band again."""
    state = Reconnect("test: reset", Backoff(initial=0.1, maximum=5.0))
    for _ in range(10):
        state.failed()
    state.succeeded()
    assert state.failed() <= 0.1


def test_each_failure_is_counted_under_its_operation() -> None:
    """calmq_operation_retries_total{what} rises by one per failure."""
    before = _retries("test: counted")
    state = Reconnect("test: counted", FAST)
    state.failed(OSError("down"))
    state.failed(OSError("down"))
    assert _retries("test: counted") == before + 2


async def test_retry_forever_returns_once_the_action_succeeds() -> None:
    """An action that fails twice is tried a third time and its result returned."""
    calls: list[int] = []

    async def flaky() -> str:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionError("database away")
        return "done"

    assert await retry_forever("test: flaky", flaky, backoff=FAST) == "done"
    assert len(calls) == 3


async def test_retry_forever_lets_other_errors_through() -> None:
    """An error outside retry_on is raised at once, not retried."""
    calls: list[int] = []

    async def broken() -> None:
        calls.append(1)
        raise ValueError("a bug")

    with pytest.raises(ValueError, match="a bug"):
        await retry_forever("test: bug", broken, backoff=FAST, retry_on=(ConnectionError,))
    assert len(calls) == 1


async def test_retry_forever_stops_when_cancelled() -> None:
    """Cancelling the caller ends the loop, even while it waits out a pause."""
    failed = asyncio.Event()

    async def down() -> None:
        failed.set()
        raise ConnectionError("database away")

    task = asyncio.create_task(retry_forever("test: cancelled", down,
                                             backoff=Backoff(initial=60, maximum=60)))
    async with asyncio.timeout(5):
        await failed.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
