"""Side tasks of a process, started together and watched by one monitor.

A service runs a few background loops beside its main work (the API: webhook dispatcher,
retention sweeper, queue-age sampler; a worker: lease heartbeat and reaper). Written one by
one, each had its own start/stop/``while True`` and a failure in one was either swallowed
for ever or ended the task silently. Here a periodic task logs and counts a failed pass and
runs again next interval; a task that ends or raises is logged and counted, and, when it was
started ``critical``, the supervisor's ``failed`` event is set so that the process stops
(procrastinate's worker does the same with its side tasks).

``Lifecycle`` is the one way a long-running process of the processors runs (`calmq worker`,
`batcher`, `forwarder`, `reaper`; compare Temporal's ``Worker.run``): start, readiness,
drain on SIGTERM or SIGINT within the grace period, and a critical side task that stops
ends the process with an error (a non-zero exit, so it is restarted), after the same drain.
Each process supplies a ``Service``; none writes its own signal handling or shutdown wait.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Awaitable, Callable
from functools import cache
from typing import TYPE_CHECKING, Protocol

from calmq.errors import InfrastructureError

if TYPE_CHECKING:
    from prometheus_client import Counter

__all__ = ["Lifecycle", "Service", "Supervisor"]

log = logging.getLogger(__name__)


@cache
def _failures() -> Counter:
    # Imported here: importing this module must not load the metrics library.
    from prometheus_client import Counter

    # ``task``: the side task's fixed name (a handful per process).
    return Counter("calmq_side_task_failures_total",
                   "Failed passes of periodic side tasks and side tasks that stopped, by task",
                   ["task", "kind"])


class Supervisor:
    """Starts side tasks, watches them, and stops them all at once.

    ``on_critical`` is called (once) when a critical task stops; the caller decides how the
    process stops (set its stop event, cancel its main task).
    """

    def __init__(self, on_critical: Callable[[str, BaseException | None], None] | None = None,
                 ) -> None:
        self._on_critical = on_critical
        self._tasks: dict[asyncio.Task[None], tuple[str, bool]] = {}
        self._stopping = False
        self._closing = False
        self.failed = asyncio.Event()  # set once a critical task stopped on its own
        self.failed_task: str | None = None  # the critical task that stopped

    def every(self, name: str, interval: float, action: Callable[[], Awaitable[object]], *,
              first_after: float = 0.0, critical: bool = False) -> None:
        """Run ``action`` every ``interval`` seconds (first after ``first_after``); a failed
        pass is logged and counted, and the next one runs on time."""

        async def periodic() -> None:
            await asyncio.sleep(first_after)  # the task's schedule, not a synchronisation
            while True:
                try:
                    await action()
                except asyncio.CancelledError:
                    raise
                except Exception:
                    _failures().labels(name, "pass").inc()
                    log.exception("%s failed; trying again in %g s", name, interval)
                await asyncio.sleep(interval)  # the task's period, not a synchronisation

        self.spawn(name, periodic, critical=critical)

    def spawn(self, name: str, run: Callable[[], Awaitable[object]], *,
              critical: bool = False) -> asyncio.Task[None]:
        """Run ``run()`` until the supervisor stops; ending or raising before then (before
        ``closing``, for ending) is a failure of the task. Returns the task."""

        async def wrapped() -> None:
            await run()

        task = asyncio.create_task(wrapped(), name=name)
        self._tasks[task] = (name, critical)
        task.add_done_callback(self._ended)
        return task

    def closing(self) -> None:
        """The process is draining: a task that ends now (a consumer thread that was told to
        stop) ended on purpose; one that raises is still a failure."""
        self._closing = True

    @property
    def names(self) -> list[str]:
        return sorted(name for name, _critical in self._tasks.values())

    def _ended(self, task: asyncio.Task[None]) -> None:
        name, critical = self._tasks.pop(task, (task.get_name(), False))
        if self._stopping or task.cancelled():
            return
        exc = task.exception()
        if exc is None and self._closing:
            return
        _failures().labels(name, "stopped").inc()
        if exc is not None:
            log.error("side task %s failed", name, exc_info=exc)
        else:
            log.error("side task %s ended on its own", name)
        if critical and not self.failed.is_set():
            self.failed.set()
            self.failed_task = name
            if self._on_critical is not None:
                self._on_critical(name, exc)

    async def stop(self) -> None:
        """Cancel every side task and wait for them to end."""
        self._stopping = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


class Service(Protocol):
    """What a process runs under its ``Lifecycle``.

    ``start`` opens what the process holds and starts its work: threads and loops go on
    ``life.side`` (the consumer thread too, as a critical task), and ``life.stop`` is the
    event a thread polls. ``drain`` runs once a stop was asked for (or a critical task
    stopped): stop taking work and let what is in flight finish within ``grace_seconds``.
    ``close`` releases everything, whether ``start`` finished or not. ``tick`` runs every
    ``Lifecycle.tick_seconds`` while the process is up (gauges, limits that follow the
    budget); most services do nothing there.
    """

    name: str

    async def start(self, life: Lifecycle) -> None: ...

    async def tick(self) -> None: ...

    async def drain(self, grace_seconds: float) -> None: ...

    async def close(self) -> None: ...


class Lifecycle:
    """Runs one ``Service``: start, ready, run until SIGTERM/SIGINT or a critical side task
    stops, drain within the grace period, close; raises ``InfrastructureError`` (the CLI
    exits non-zero) when it stopped because a critical side task did."""

    def __init__(self, service: Service, *, grace_seconds: float = 30.0,
                 tick_seconds: float = 0.1) -> None:
        self.service = service
        self.grace_seconds = grace_seconds
        self.tick_seconds = tick_seconds
        # A threading.Event: the processes' Kafka threads poll it.
        self.stop = threading.Event()
        self.ready = threading.Event()  # set once the service started
        self.side = Supervisor(on_critical=self._critical)

    def request_stop(self, reason: str = "asked to") -> None:
        """Ask the process to drain and stop (safe from any thread, and more than once)."""
        if not self.stop.is_set():
            log.info("%s stopping: %s", self.service.name, reason)
        # Before the stop event: a thread that sees it and ends has ended on purpose.
        self.side.closing()
        self.stop.set()

    def _critical(self, name: str, _exc: BaseException | None) -> None:
        log.error("stopping %s: its side task %s stopped", self.service.name, name)
        self.request_stop(f"side task {name} stopped")

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        signals: list[signal.Signals] = []
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                loop.add_signal_handler(sig, self.request_stop, f"signal {sig.name}")
            except (ValueError, RuntimeError):  # not the main thread (a test's own loop)
                continue
            signals.append(sig)
        try:
            await self.service.start(self)
            self.ready.set()
            log.info("%s ready", self.service.name)
            while not self.stop.is_set():
                await self.service.tick()
                # The process's pace, and how fast a stop is noticed: one timer, so that a
                # worker's loop-lag gauge (measured across it) sees the loop, not the
                # machinery of a wait with a timeout (a task and its cancellation per tick).
                await asyncio.sleep(self.tick_seconds)
            self.side.closing()  # stopped by a critical task: no stop request marked it
            await self.service.drain(self.grace_seconds)
        finally:
            self.ready.clear()
            self.stop.set()
            await self.side.stop()
            await self.service.close()
            for sig in signals:
                loop.remove_signal_handler(sig)
        if self.side.failed.is_set():
            # Not a clean exit: the process is restarted, and its exit says why it stopped.
            raise InfrastructureError(
                f"{self.service.name} stopped because its side task "
                f"{self.side.failed_task} stopped", code="side_task_stopped")
