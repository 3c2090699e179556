"""Database-side gauges the API samples: queue age, the replication slots' retained WAL and
the tables' health (dead tuples, wraparound, the oldest transaction).

Sampled from PostgreSQL by the API, not by workers or the relay: the API runs whether or not
a pool has workers or a relay streams, and a pool whose workers are all down, or a slot whose
relay is gone, is exactly when these values must keep rising. One cheap query each
(calmq/sql/observability.sql) every ``CALMQ_QUEUE_AGE_INTERVAL_SECONDS``; every API replica
reports the same values, so dashboards and alerts take ``max`` over instances.

Queue age: how long the oldest waiting job of each pool and priority has waited. A pair that
had waiting jobs and has none now reads 0, and so does, from the start, every pair of a pool
the API's workflows route to: a fast pool whose jobs never wait at a sample still has its
series, so a dashboard's pool list (label values of this gauge) names every pool.

Slots: per replication slot of the database, the WAL the server keeps for it and whether a
process streams from it. A slot nobody streams from keeps WAL until the disk is full; the
relay's own ``calmq_relay_slot_retained_wal_bytes`` cannot show that, because the relay is
what is missing. A dropped slot's series are removed, not set to 0.

Tables: dead tuples per table (partitions summed under their table) and their share, the
age of the database's oldest unfrozen transaction ID, the oldest open transaction's age, and
the share of the NOTIFY queue in use, every ``CALMQ_TABLE_HEALTH_INTERVAL_SECONDS``.
Autovacuum keeps the first two down on its own (migration 0029 tunes it for the hot tables);
the alerts on them say when it cannot: a transaction left open, vacuum outpaced, or freezing
behind on the way to wraparound. The NOTIFY queue fills when a listening session stops
reading (its notifications wait for it), and a full one fails every commit that notifies.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from functools import cache

from prometheus_client import Gauge

from calmq.data import Database
from calmq.data.observability import (
    SlotState,
    TableHealth,
    TransactionAges,
    queue_ages,
    replication_slots,
    table_health,
    transaction_ages,
)
from calmq.jobs import Priority

__all__ = ["QueueAge", "SlotWatch", "TableWatch", "queue_age_gauge", "slot_gauges",
           "table_gauges"]


@cache
def queue_age_gauge() -> Gauge:
    # Labels: pools (a handful, from the workflows) and the two priorities.
    return Gauge("calmq_queue_age_seconds",
                 "Age of the oldest queued or retrying job, by pool and priority",
                 ["pool", "priority"])


@cache
def slot_gauges() -> tuple[Gauge, Gauge]:
    """(retained WAL bytes, active) by slot. Slots are bounded by max_replication_slots."""
    retained = Gauge("calmq_replication_slot_retained_wal_bytes",
                     "WAL the server keeps for a replication slot of the database "
                     "(sampled from PostgreSQL, whether or not a relay runs)", ["slot"])
    active = Gauge("calmq_replication_slot_active",
                   "1 while a process streams from the replication slot, 0 when none does",
                   ["slot"])
    return retained, active


@dataclass(frozen=True)
class TableGauges:
    dead: Gauge
    dead_ratio: Gauge
    xid_age: Gauge
    oldest_transaction: Gauge
    slot_xmin_age: Gauge
    notification_queue: Gauge


@cache
def table_gauges() -> TableGauges:
    # Labels: the tables of calmq's schema (a fixed set; partitions are summed, not listed).
    return TableGauges(
        dead=Gauge("calmq_db_dead_tuples",
                   "Dead tuples of a calmq table (partitions summed), as PostgreSQL's "
                   "statistics estimate them", ["table"]),
        dead_ratio=Gauge("calmq_db_dead_tuple_ratio",
                         "Dead tuples over all tuples of a calmq table: what vacuum has not "
                         "reclaimed yet", ["table"]),
        xid_age=Gauge("calmq_db_xid_age",
                      "Age in transactions of the database's oldest unfrozen transaction ID; "
                      "PostgreSQL stops writes near 2^31"),
        oldest_transaction=Gauge("calmq_db_oldest_transaction_seconds",
                                 "How long the oldest open client transaction of the database "
                                 "has run; vacuum keeps every row version since it began"),
        slot_xmin_age=Gauge("calmq_db_replication_slot_xmin_age",
                            "Age in transactions of the oldest xmin a replication slot holds "
                            "back (0: none)"),
        notification_queue=Gauge("calmq_db_notification_queue_usage",
                                 "Share (0 to 1) of PostgreSQL's NOTIFY queue in use "
                                 "(pg_notification_queue_usage()); at 1 every NOTIFY, and "
                                 "every commit that sends one, fails"))


class QueueAge:
    def __init__(self, db: Database, interval: float, pools: Iterable[str] = ()) -> None:
        self._db = db
        self.interval = interval  # between samples, taken by a side task; 0: never
        self._known = {(pool, p.value) for pool in pools for p in Priority}
        self._seen: set[tuple[str, str]] = set()

    def declare(self) -> None:
        """Give every known pool's pairs a series (0: nothing waits) before the first sample."""
        gauge = queue_age_gauge()
        for pair in self._known - self._seen:
            gauge.labels(*pair).set(0)
        self._seen |= self._known

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


class SlotWatch:
    def __init__(self, db: Database, interval: float) -> None:
        self._db = db
        self.interval = interval  # between samples, taken by a side task; 0: never
        self._seen: set[str] = set()

    async def sample(self) -> list[SlotState]:
        """Read the database's replication slots once and set the gauges; returns them."""
        slots = await replication_slots(self._db)
        retained, active = slot_gauges()
        names = {s.slot for s in slots}
        for gone in self._seen - names:
            retained.remove(gone)
            active.remove(gone)
        for s in slots:
            retained.labels(s.slot).set(s.retained_bytes)
            active.labels(s.slot).set(1 if s.active else 0)
        self._seen = names
        return slots


class TableWatch:
    def __init__(self, db: Database, interval: float) -> None:
        self._db = db
        self.interval = interval  # between samples, taken by a side task; 0: never

    async def sample(self) -> tuple[list[TableHealth], TransactionAges]:
        """Read the tables' dead tuples and the transaction ages once and set the gauges."""
        tables = await table_health(self._db)
        ages = await transaction_ages(self._db)
        gauges = table_gauges()
        for t in tables:
            gauges.dead.labels(t.table).set(t.dead)
            gauges.dead_ratio.labels(t.table).set(t.dead_ratio)
        gauges.xid_age.set(ages.xid_age)
        gauges.oldest_transaction.set(ages.oldest_transaction_seconds)
        gauges.slot_xmin_age.set(ages.slot_xmin_age)
        gauges.notification_queue.set(ages.notification_queue_usage)
        return tables, ages
