"""Fair use of one API process: a rate per key, and caps per tenant on what holds resources.

One tenant's key must not starve the others of what every request shares: the event loop,
the database pool (16 connections for intake, reads and streams alike) and memory.

- ``RateLimiter``: a token bucket per API key (``api_rate_per_second``, ``api_rate_burst``;
  0: off). A request past its key's bucket answers 429 ``rate_limited`` with
  ``Retry-After`` (the seconds until a token is back), before any database work.
- ``RateLimiter`` again, per client address, for requests without a valid key
  (``api_unauthenticated_rate_per_second``, ``api_unauthenticated_rate_burst``): a missing,
  unknown or revoked key spends its address's bucket, and an address whose bucket is empty
  answers 429 ``unauthenticated_rate_limited`` before its key is even looked up, so random
  keys cannot turn into a database read each (producers/auth.py).
- ``TenantGates``: how many SSE streams (``api_streams_per_tenant``) and how many expensive
  reads at once (lists, artifact downloads: ``api_reads_per_tenant``) one tenant holds in
  this process. Past its cap a request answers 429 ``too_many_streams`` /
  ``too_many_reads`` at once, rather than waiting (a waiting request still holds a
  connection and memory).

Both are per process: N API replicas allow N times as much (docs/explanation/security.md).
"""

from __future__ import annotations

import contextlib
import math
import time
import uuid
from collections import OrderedDict
from collections.abc import Iterator

from calmq.errors import ContractError

__all__ = ["RateLimiter", "TenantGates", "Throttled"]

# Buckets kept for this many keys at most: the least recently used is forgotten first (a
# forgotten key starts again with a full bucket, which only ever allows more).
_MAX_BUCKETS = 50_000


class Throttled(ContractError):
    """429: the caller sent more than its share; ``retry_after`` seconds until it may again."""

    def __init__(self, message: str, *, code: str, retry_after: float) -> None:
        super().__init__(message, code=code, status=429)
        self.retry_after = retry_after

    @property
    def retry_after_header(self) -> str:
        """The ``Retry-After`` value: whole seconds, at least 1."""
        return str(max(1, math.ceil(self.retry_after)))


class RateLimiter:
    """A token bucket per key: ``rate`` tokens a second, at most ``burst`` at once."""

    def __init__(self, rate: float, burst: int) -> None:
        self.rate = rate
        self.burst = max(1, burst)
        # key -> (tokens, monotonic time they were counted)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()

    @property
    def enabled(self) -> bool:
        return self.rate > 0

    def wait(self, key: str, now: float | None = None) -> float:
        """The seconds until ``key`` has a token, without taking one (0: it has one now)."""
        if not self.enabled:
            return 0.0
        now = time.monotonic() if now is None else now
        tokens, since = self._buckets.get(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - since) * self.rate)
        return 0.0 if tokens >= 1.0 else (1.0 - tokens) / self.rate

    def take(self, key: str, now: float | None = None) -> float:
        """Take one token for ``key``; 0 if it had one, else the seconds until it will."""
        if not self.enabled:
            return 0.0
        now = time.monotonic() if now is None else now
        tokens, since = self._buckets.pop(key, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - since) * self.rate)
        if tokens >= 1.0:
            self._buckets[key] = (tokens - 1.0, now)
            wait = 0.0
        else:
            self._buckets[key] = (tokens, now)
            wait = (1.0 - tokens) / self.rate
        while len(self._buckets) > _MAX_BUCKETS:
            self._buckets.popitem(last=False)
        return wait

    def check(self, key: str) -> None:
        """Raise Throttled (429 ``rate_limited``) when ``key`` is past its rate."""
        wait = self.take(key)
        if wait > 0:
            raise Throttled(
                f"this API key sent more than {self.rate:g} requests a second (burst "
                f"{self.burst}); try again in {wait:.2f} s (settings api_rate_per_second, "
                "api_rate_burst)", code="rate_limited", retry_after=wait)


class TenantGates:
    """Counts of what each tenant holds open, by kind, each with its cap (0: no cap)."""

    # The code and the setting named in a refusal, per kind.
    _KINDS = {"stream": ("too_many_streams", "api_streams_per_tenant", "open event streams"),
              "read": ("too_many_reads", "api_reads_per_tenant", "list or download requests")}

    def __init__(self, *, streams: int, reads: int) -> None:
        self._caps = {"stream": streams, "read": reads}
        self._held: dict[tuple[str, uuid.UUID], int] = {}

    def held(self, kind: str, tenant_id: uuid.UUID) -> int:
        return self._held.get((kind, tenant_id), 0)

    @contextlib.contextmanager
    def hold(self, kind: str, tenant_id: uuid.UUID) -> Iterator[None]:
        """Hold one of ``tenant_id``'s ``kind`` places while the block runs; Throttled (429)
        at once if the tenant holds its cap already."""
        cap = self._caps[kind]
        key = (kind, tenant_id)
        held = self._held.get(key, 0)
        if cap and held >= cap:
            code, setting, what = self._KINDS[kind]
            raise Throttled(
                f"this tenant has {held} {what} in progress in this API process, its cap "
                f"(setting {setting}); close one or try again shortly", code=code,
                retry_after=1.0)
        self._held[key] = held + 1
        try:
            yield
        finally:
            left = self._held.get(key, 1) - 1
            if left > 0:
                self._held[key] = left
            else:
                self._held.pop(key, None)
