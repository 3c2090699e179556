"""Side tasks under one supervisor: failed passes retried and counted, critical stops reported."""

from __future__ import annotations

import asyncio

from prometheus_client import REGISTRY

from calmq.supervision import Supervisor


def _failures(task: str, kind: str) -> float:
    return REGISTRY.get_sample_value("calmq_side_task_failures_total",
                                     {"task": task, "kind": kind}) or 0.0


async def test_a_failed_pass_is_counted_and_the_next_one_runs() -> None:
    """A periodic task whose pass raises runs again at the next interval."""
    passes: list[int] = []
    third = asyncio.Event()

    async def sweep() -> None:
        passes.append(1)
        if len(passes) == 3:
            third.set()
        if len(passes) == 1:
            raise ConnectionError("database away")

    before = _failures("test-sweeper", "pass")
    side = Supervisor()
    side.every("test-sweeper", 0.001, sweep)
    async with asyncio.timeout(5):
        await third.wait()
    await side.stop()
    assert _failures("test-sweeper", "pass") == before + 1
    assert not side.failed.is_set()


async def test_a_critical_task_that_stops_is_reported() -> None:
    """A critical side task that raises sets ``failed`` and calls on_critical with its error."""
    reported: list[tuple[str, BaseException | None]] = []

    async def heartbeat() -> None:
        raise RuntimeError("lost the connection for good")

    side = Supervisor(on_critical=lambda name, exc: reported.append((name, exc)))
    side.spawn("test-heartbeat", heartbeat, critical=True)
    async with asyncio.timeout(5):
        await side.failed.wait()
    await side.stop()
    assert [name for name, _ in reported] == ["test-heartbeat"]
    assert isinstance(reported[0][1], RuntimeError)
    assert _failures("test-heartbeat", "stopped") >= 1


async def test_a_side_task_that_ends_is_counted_but_not_critical() -> None:
    """A non-critical task that ends on its own is counted; the supervisor keeps running."""
    ended = asyncio.Event()

    async def once() -> None:
        ended.set()

    before = _failures("test-once", "stopped")
    side = Supervisor(on_critical=lambda _n, _e: None)
    side.spawn("test-once", once)
    async with asyncio.timeout(5):
        await ended.wait()
        while "test-once" in side.names:  # noqa: ASYNC110 - its done callback: a loop turn
            await asyncio.sleep(0)
    assert _failures("test-once", "stopped") == before + 1
    assert not side.failed.is_set()
    await side.stop()


async def test_stop_cancels_every_task_without_counting_failures() -> None:
    """stop() ends all side tasks; being stopped is not a failure."""
    started = asyncio.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    side = Supervisor(on_critical=lambda _n, _e: None)
    side.spawn("test-forever", forever, critical=True)
    side.every("test-periodic", 3600, lambda: asyncio.sleep(0))
    async with asyncio.timeout(5):
        await started.wait()
    before = _failures("test-forever", "stopped")
    await side.stop()
    assert side.names == []
    assert _failures("test-forever", "stopped") == before
    assert not side.failed.is_set()
