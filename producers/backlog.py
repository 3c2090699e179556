"""Queue age: how long the oldest waiting job of each pool and priority has waited.

Sampled from PostgreSQL by the API, not by workers: the API runs whether or not a pool has
workers, and a pool whose workers are all down is exactly when its queue age must keep
rising. One cheap indexed query (calmq/sql/observability.sql) every
``CALMQ_QUEUE_AGE_INTERVAL_SECONDS``; every API replica reports the same values, so
dashboards take ``max`` over instances. A pair that had waiting jobs and has none now reads 0.
"""

from __future__ import annotations

from functools import cache

from prometheus_client import Gauge

from calmq.data import Database
from calmq.data.observability import queue_ages

__all__ = ["QueueAge", "queue_age_gauge"]


@cache
def queue_age_gauge() -> Gauge:
    # Labels: pools (a handful, from the workflows) and the two priorities.
    return Gauge("calmq_queue_age_seconds",
                 "Age of the oldest queued or retrying job, by pool and priority",
                 ["pool", "priority"])


class QueueAge:
    def __init__(self, db: Database, interval: float) -> None:
        self._db = db
        self.interval = interval  # between samples, taken by a side task; 0: never
        self._seen: set[tuple[str, str]] = set()

    async def sample(self) -> dict[tuple[str, str], float]:
        """Read the ages once and set the gauge; returns them."""
        ages = await queue_ages(self._db)
        gauge = queue_age_gauge()
        for pair in self._seen - ages.keys():
            gauge.labels(*pair).set(0)
        for pair, age in ages.items():
            gauge.labels(*pair).set(age)
        self._seen |= ages.keys()
        return ages
