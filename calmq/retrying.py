"""Backoff with jitter, and the one retry loop for "the database (or Kafka) is away".

``Backoff`` is the project's single delay rule: exponential, and jittered over each attempt's
own band (see ``Backoff.delay`` for why not plain full jitter). The failure policy
(processors/policy.py) uses it for job retries, the webhook dispatcher for deliveries, and
``Reconnect`` / ``retry_forever`` for every loop that waits out an outage: without jitter a
fleet that lost its database at the same moment reconnects in lockstep, and keeps doing so.

Own code rather than stamina: the band jitter is the documented choice and stamina's jitter
is additive; what the loops need (retry forever, log, count) fits in this module.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from prometheus_client import Counter

__all__ = ["RECONNECT", "Backoff", "Reconnect", "retry_forever"]

log = logging.getLogger(__name__)

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class Backoff:
    initial: float = 1.0
    maximum: float = 3600.0
    multiplier: float = 2.0

    def ceiling(self, attempt: int) -> float:
        """The exponential cap of attempt ``attempt`` (0 for attempt 0)."""
        if attempt < 1:
            return 0.0
        return min(self.maximum, self.initial * self.multiplier ** (attempt - 1))

    def delay(self, attempt: int, rng: random.Random | None = None) -> float:
        """Full jitter over the attempt's own band: uniform in
        [ceiling(attempt - 1), ceiling(attempt)].

        Plain full jitter draws from [0, ceiling] and so may wait less before the third
        attempt than before the second; drawing each attempt from the band above the
        previous cap keeps the spread that breaks up a thundering herd (the whole band is
        used) while the delays between attempts always grow (until the maximum).
        """
        return (rng or random).uniform(self.ceiling(attempt - 1), self.ceiling(attempt))


# What the reconnect loops used before they shared this module (0.1 s doubling to 5 s).
RECONNECT = Backoff(initial=0.1, maximum=5.0, multiplier=2.0)


@cache
def _retries() -> Counter:
    # Imported here: importing this module must not load the metrics library.
    from prometheus_client import Counter

    # ``what`` is a fixed phrase per call site (a handful), never a message or an id.
    return Counter("calmq_operation_retries_total",
                   "Failed tries of an operation retried until it succeeds, by operation",
                   ["what"])


class Reconnect:
    """One retry loop's state: failures in a row, and the jittered pause after the next one.

    For loops that cannot be a single ``retry_forever`` call (a thread that waits on a stop
    event, a connection that resets the count once it is up again). ``what`` names the
    failure in the log and in the ``calmq_operation_retries_total{what}`` metric ("claiming
    a batch failed"): keep it a fixed phrase.
    """

    __slots__ = ("_top", "backoff", "failures", "rng", "what")

    def __init__(self, what: str, backoff: Backoff = RECONNECT, *,
                 rng: random.Random | None = None) -> None:
        self.what = what
        self.backoff = backoff
        self.rng = rng
        self.failures = 0
        self._top = 0  # found at the first failure: most operations never fail

    def failed(self, exc: BaseException | None = None) -> float:
        """Count a failure, log it, and return how long to wait before the next try."""
        if not self._top:
            # The first attempt whose band reaches the maximum. Counting stops there: the
            # band above it is a single point (the maximum), and a fleet waiting exactly
            # the maximum would be in lockstep again.
            top = 1
            while self.backoff.ceiling(top) < self.backoff.maximum and top < 64:
                top += 1
            self._top = top
        self.failures += 1
        delay = self.backoff.delay(min(self.failures, self._top), self.rng)
        _retries().labels(self.what).inc()
        log.warning("%s (%s); retrying in %.2f s", self.what,
                    f"{type(exc).__name__}: {str(exc).strip()}" if exc is not None else "failed",
                    delay, exc_info=exc if self.failures == 1 else None,
                    extra={"retry_of": self.what, "failures": self.failures})
        return delay

    def succeeded(self) -> None:
        """The operation works again: the next outage starts from the shortest pause."""
        self.failures = 0


async def retry_forever(what: str, action: Callable[[], Awaitable[_T]], *,
                        backoff: Backoff = RECONNECT,
                        retry_on: tuple[type[BaseException], ...] = (Exception,)) -> _T:
    """Await ``action()`` until it returns, pausing (jittered) after each failure.

    For work that must not be dropped while the database or Kafka is away (a batch's
    outcomes, a claim): losing it would stall its partitions' commits for good.
    Cancellation is never retried.
    """
    state = Reconnect(what, backoff)
    while True:
        try:
            return await action()
        except asyncio.CancelledError:
            raise
        except retry_on as exc:
            await asyncio.sleep(state.failed(exc))  # the pause of an outage, not a sync
