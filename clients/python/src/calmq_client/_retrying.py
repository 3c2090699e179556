"""When a call is tried again, and after how long.

A call is tried again only when that cannot do harm: a read, or a submit with an
idempotency key, after any failure a retry may cure (a dropped connection, 429, 502, 503,
504); a call that is not safe to repeat only when the API certainly did not act on it
(the connection was never made, or the API answered 429 or 503, which it does before it
writes anything). The pause grows with each try, jittered, and is never shorter than the
``Retry-After`` the API sent.
"""

from __future__ import annotations

import email.utils
import random
import time
from dataclasses import dataclass, field
from typing import Protocol

from calmq_client._errors import ClientError

__all__ = ["Attempts", "Backoff", "Pauses", "RetryPolicy", "retry_after"]

# What a retry may cure: the API or the network was away, the API shed load (503 while its
# database is unreachable, 429 for the tenant's rate), or a proxy in front answered for it.
RETRY_STATUSES = frozenset({429, 502, 503, 504})
# The API answers these before it writes anything: even a call that is not idempotent may
# be sent again. A 502 or 504 comes from a proxy that may have passed the request on.
NOT_ACTED_ON = frozenset({429, 503})


class Pauses(Protocol):
    """Anything that says how long to pause before try ``attempt`` + 1 (1-based)."""

    def delay(self, attempt: int) -> float: ...


@dataclass(frozen=True, slots=True)
class Backoff:
    """Exponential pauses with jitter over each attempt's own band: uniform between the
    previous attempt's cap and this one's, so a crowd of clients spreads out and each
    client's pauses still grow (until ``maximum``)."""

    initial: float = 0.2
    maximum: float = 10.0
    multiplier: float = 2.0

    def _cap(self, attempt: int) -> float:
        if attempt < 1:
            return 0.0
        return min(self.maximum, self.initial * self.multiplier ** (attempt - 1))

    def delay(self, attempt: int) -> float:
        return random.uniform(self._cap(attempt - 1), self._cap(attempt))


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """How long a call keeps trying: ``attempts`` tries in all, within ``max_elapsed``
    seconds, pausing per ``backoff`` or longer if the API says so. ``statuses``: the answers
    that may be retried. ``RetryPolicy(attempts=1)`` turns retrying off."""

    attempts: int = 8
    max_elapsed: float = 120.0
    backoff: Pauses = field(default_factory=Backoff)
    statuses: frozenset[int] = RETRY_STATUSES


class Attempts:
    """One call's tries under a policy. An event stream calls ``reset`` whenever it makes
    progress, so a long stream is not ended by failures hours apart."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.reset()

    def reset(self) -> None:
        self.failures = 0
        self.started = time.monotonic()

    def pause(self, error: ClientError, wait: float) -> float:
        """The pause before the next try after ``error`` (``wait``: the least the API asked
        for); raises ``error`` when the policy is spent or the pause would outlast it."""
        self.failures += 1
        policy = self.policy
        pause = max(policy.backoff.delay(self.failures), wait)
        if (self.failures >= policy.attempts
                or time.monotonic() - self.started + pause > policy.max_elapsed):
            raise error
        return pause


def retry_after(value: str | None) -> float | None:
    """``Retry-After`` in seconds: delta-seconds or an HTTP date."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())
