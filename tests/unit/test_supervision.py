"""Side tasks under one supervisor: failed passes retried and counted, critical stops reported;
the processes' one lifecycle: start, ready, drain on a stop, an error exit after a critical stop."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY

from calmq.errors import InfrastructureError
from calmq.supervision import Lifecycle, Supervisor


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


class _Service:
    """A service that records its lifecycle's calls (a real implementation of the protocol)."""

    name = "test-service"

    def __init__(self, *, fail_start: bool = False) -> None:
        self.calls: list[str] = []
        self.fail_start = fail_start
        self.life: Lifecycle | None = None

    async def start(self, life: Lifecycle) -> None:
        self.calls.append("start")
        self.life = life
        if self.fail_start:
            raise ConnectionError("the database is away")

    async def tick(self) -> None:
        if self.calls[-1] != "tick":
            self.calls.append("tick")

    async def drain(self, grace_seconds: float) -> None:
        self.calls.append(f"drain {grace_seconds:g}")

    async def close(self) -> None:
        self.calls.append("close")


async def _until(check: Callable[[], bool]) -> None:
    async with asyncio.timeout(5):
        while not check():  # noqa: ASYNC110 - polls a condition with a deadline
            await asyncio.sleep(0.001)  # poll


async def test_a_stop_request_drains_within_the_grace_and_closes() -> None:
    """A stop (what SIGTERM asks for) drains with the grace period, closes, and returns."""
    service = _Service()
    life = Lifecycle(service, grace_seconds=7, tick_seconds=0.01)
    task = asyncio.create_task(life.run())
    await _until(life.ready.is_set)
    life.request_stop("test")
    await task
    assert service.calls == ["start", "tick", "drain 7", "close"]
    assert not life.ready.is_set()


async def test_a_critical_side_task_that_stops_ends_the_process_with_an_error() -> None:
    """A critical side task that raises stops the process: drained and closed like a stop,
    then run() raises (the CLI exits non-zero) naming the task."""
    service = _Service()
    life = Lifecycle(service, grace_seconds=1, tick_seconds=0.01)
    task = asyncio.create_task(life.run())
    await _until(life.ready.is_set)

    async def consumer_thread() -> None:
        raise RuntimeError("the consumer thread died")

    life.side.spawn("test-consumer-thread", consumer_thread, critical=True)
    with pytest.raises(InfrastructureError) as raised:
        await task
    assert raised.value.code == "side_task_stopped"
    assert "test-consumer-thread" in raised.value.message
    assert service.calls == ["start", "tick", "drain 1", "close"]


async def test_a_side_task_that_ends_while_draining_is_no_failure() -> None:
    """A critical task that ends once the process drains (a consumer thread told to stop)
    ended on purpose: the process exits cleanly."""
    service = _Service()
    life = Lifecycle(service, grace_seconds=1, tick_seconds=0.01)
    task = asyncio.create_task(life.run())
    await _until(life.ready.is_set)
    stopped = asyncio.Event()

    async def polls_until_stopped() -> None:
        while not life.stop.is_set():  # noqa: ASYNC110 - polls the stop event like a thread
            await asyncio.sleep(0.001)  # poll
        stopped.set()

    life.side.spawn("test-poller", polls_until_stopped, critical=True)
    life.request_stop("test")
    await task
    assert stopped.is_set()
    assert not life.side.failed.is_set()


async def test_a_service_that_cannot_start_is_closed_and_raises() -> None:
    """A start that fails releases what was opened (close) and raises its error."""
    service = _Service(fail_start=True)
    life = Lifecycle(service, grace_seconds=1, tick_seconds=0.01)
    with pytest.raises(ConnectionError):
        await life.run()
    assert service.calls == ["start", "close"]
    assert not life.ready.is_set()
