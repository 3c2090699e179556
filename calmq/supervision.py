"""Side tasks of a process, started together and watched by one monitor.

A service runs a few background loops beside its main work (the API: webhook dispatcher,
retention sweeper, queue-age sampler; a worker: lease heartbeat and reaper). Written one by
one, each had its own start/stop/``while True`` and a failure in one was either swallowed
for ever or ended the task silently. Here a periodic task logs and counts a failed pass and
runs again next interval; a task that ends or raises is logged and counted, and, when it was
started ``critical``, the supervisor's ``failed`` event is set so that the process stops
(procrastinate's worker does the same with its side tasks).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from prometheus_client import Counter

__all__ = ["Supervisor"]

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
        self.failed = asyncio.Event()  # set once a critical task stopped on its own

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

    def spawn(self, name: str, run: Callable[[], Awaitable[None]], *,
              critical: bool = False) -> None:
        """Run ``run()`` until the supervisor stops; ending or raising before then is a
        failure of the task."""

        async def wrapped() -> None:
            await run()

        task = asyncio.create_task(wrapped(), name=name)
        self._tasks[task] = (name, critical)
        task.add_done_callback(self._ended)

    @property
    def names(self) -> list[str]:
        return sorted(name for name, _critical in self._tasks.values())

    def _ended(self, task: asyncio.Task[None]) -> None:
        name, critical = self._tasks.pop(task, (task.get_name(), False))
        if self._stopping or task.cancelled():
            return
        exc = task.exception()
        _failures().labels(name, "stopped").inc()
        if exc is not None:
            log.error("side task %s failed", name, exc_info=exc)
        else:
            log.error("side task %s ended on its own", name)
        if critical and not self.failed.is_set():
            self.failed.set()
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
