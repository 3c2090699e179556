"""Consumer lag: the one reader of how far calmq's consumer groups are behind.

Three places want it: a worker's ``calmq_consumer_lag_messages`` gauge (the partitions it
owns; autoscaling reads it), the console's overview (the fleet: every group and topic) and
`calmq lag` (every partition of the work topics, with its offsets). They read it here, the
same way, with what the worker's sampler learned the hard way:

- **Committed offsets from a consumer that never joins the group** (``committed()``: one
  OffsetFetch for all partitions), never the admin client's group requests
  (``list_consumer_group_offsets``, ``describe_consumer_groups``): when the broker goes
  away, a timed-out group request of the admin client aborts the whole process inside
  librdkafka (assertion ``eonce->refcnt > 0``, confluentinc/librdkafka#4605, open; both
  workers died in the chaos test's Kafka restart). Reading joins no group, so it never
  rebalances the workers either.
- **A failed read replaces the clients.** After a broker restart an admin client kept the
  partitions' old leader epochs and answered every later read FENCED_LEADER_EPOCH (the lag
  gauge froze for good in the chaos test); new clients start from fresh metadata.
- **Every broker request has a timeout**, and the groups are derived from the topics'
  names (:func:`calmq.topics.consumer_group`), not listed from the brokers.

Watermarks come from the admin client's ``list_offsets`` (one request for all partitions).
A partition's lag is its high watermark minus the group's committed offset; a partition
never committed, or committed below what retention kept, counts from its low watermark.
The calls block on broker round trips: callers on an event loop run them in a thread.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from calmq import topics
from calmq.kafka import connection_of

if TYPE_CHECKING:
    from confluent_kafka import Consumer
    from confluent_kafka.admin import AdminClient

__all__ = ["GroupLag", "LagReader", "PartitionLag", "client_config", "per_group_topic"]

log = logging.getLogger(__name__)

R = TypeVar("R")

def client_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The connection settings of a Kafka client configuration: a consumer's less its
    group's own settings (calmq.kafka.connection_of), so the reader reaches the brokers
    exactly as that consumer does (security, pass-through properties, an ``oauth_cb``)."""
    return connection_of(config)


@dataclass(frozen=True, slots=True)
class PartitionLag:
    """One partition as a consumer group sees it."""

    group: str
    topic: str
    partition: int
    start_offset: int  # the low watermark: older messages are gone (retention)
    end_offset: int  # the high watermark: the next message's offset
    committed_offset: int | None  # None: the group never committed on this partition

    @property
    def lag(self) -> int:
        """Messages the group has not committed yet (of those the log still holds)."""
        done = self.committed_offset
        start = self.start_offset if done is None else max(done, self.start_offset)
        return max(0, self.end_offset - start)


@dataclass(frozen=True, slots=True)
class GroupLag:
    """A group's lag over one topic's partitions."""

    group: str
    topic: str
    lag: int
    partitions: int


def per_group_topic(rows: Iterable[PartitionLag]) -> list[GroupLag]:
    """Partitions summed per (group, topic), in name order."""
    sums: dict[tuple[str, str], list[int]] = {}
    for r in rows:
        acc = sums.setdefault((r.group, r.topic), [0, 0])
        acc[0] += r.lag
        acc[1] += 1
    return [GroupLag(g, t, lag, n) for (g, t), (lag, n) in sorted(sums.items())]


class LagReader:
    """Reads committed offsets and watermarks; thread-safe (one read at a time).

    ``config``: a Kafka client configuration (a consumer's will do: only its connection
    settings are used).
    """

    def __init__(self, config: Mapping[str, Any], *, timeout: float = 5.0) -> None:
        self.config = client_config(config)
        self.timeout = timeout
        self._admin: AdminClient | None = None
        self._readers: dict[str, Consumer] = {}
        self._lock = threading.Lock()

    def topics(self) -> dict[str, list[int]]:
        """calmq's topics in the cluster and their partitions (raises when no broker
        answers: an empty answer would read as "no lag")."""
        with self._lock:
            return self._guarded(self._topics)

    def read(self, group: str, partitions: Sequence[tuple[str, int]]) -> list[PartitionLag]:
        """``group``'s offsets on ``partitions``."""
        with self._lock:
            return self._guarded(lambda: self._read(group, partitions))

    def read_groups(self, groups: Mapping[str, Sequence[str]], *, committed_only: bool = False
                    ) -> list[PartitionLag]:
        """Every partition of each group's topics (``{group: [topic, ...]}``), watermarks
        read once for all. ``committed_only``: leave out the topics a group never committed
        on (a group that exists only in name)."""
        with self._lock:
            return self._guarded(lambda: self._read_groups(groups, committed_only))

    def read_fleet(self) -> list[PartitionLag]:
        """Every calmq consumer group on every topic of its, as far as the group committed
        on the topic: the workers' ``calmq.<pool>``, the batchers' and the forwarder's."""
        with self._lock:
            def fleet() -> list[PartitionLag]:
                groups: dict[str, list[str]] = {}
                for topic in self._topics():
                    group = topics.consumer_group(topic)
                    if group is not None:
                        groups.setdefault(group, []).append(topic)
                return self._read_groups(groups, committed_only=True)
            return self._guarded(fleet)

    def close(self) -> None:
        with self._lock:
            self._drop()

    # -- inside the lock -------------------------------------------------------------------

    def _guarded(self, read: Callable[[], R]) -> R:
        try:
            return read()
        except Exception:
            # Fresh clients (fresh metadata) for the next read: see the module's docstring.
            self._drop()
            raise

    def _drop(self) -> None:
        readers, self._readers, self._admin = self._readers, {}, None
        for reader in readers.values():
            try:
                reader.close()
            except Exception as exc:  # noqa: BLE001 - a client being replaced may be broken
                log.debug("closing a lag reader's consumer failed: %s", exc)

    def _admin_client(self) -> AdminClient:
        if self._admin is None:
            from confluent_kafka.admin import AdminClient

            self._admin = AdminClient({**self.config,
                                       "socket.timeout.ms": int(self.timeout * 1000)})
        return self._admin

    def _reader(self, group: str) -> Consumer:
        """A consumer of the group that never subscribes (so never joins it): it only reads
        the group's committed offsets."""
        reader = self._readers.get(group)
        if reader is None:
            from confluent_kafka import Consumer

            reader = self._readers[group] = Consumer({
                **self.config, "group.id": group, "enable.auto.commit": False,
                "socket.timeout.ms": int(self.timeout * 1000)})
        return reader

    def _topics(self) -> dict[str, list[int]]:
        metadata = self._admin_client().list_topics(timeout=self.timeout)
        return {name: sorted(t.partitions) for name, t in metadata.topics.items()
                if name.startswith(topics.PREFIX) and t.error is None}

    def _committed(self, group: str, partitions: Sequence[tuple[str, int]]
                   ) -> dict[tuple[str, int], int]:
        from confluent_kafka import TopicPartition

        reply = self._reader(group).committed(
            [TopicPartition(t, p) for t, p in partitions], timeout=self.timeout)
        return {(tp.topic, tp.partition): tp.offset for tp in reply}

    def _watermarks(self, partitions: Iterable[tuple[str, int]]
                    ) -> tuple[dict[tuple[str, int], int], dict[tuple[str, int], int]]:
        from confluent_kafka import TopicPartition
        from confluent_kafka.admin import OffsetSpec  # type: ignore[attr-defined]

        parts = sorted(set(partitions))
        if not parts:
            return {}, {}
        admin = self._admin_client()

        def offsets(spec: Any) -> dict[tuple[str, int], int]:
            futures = admin.list_offsets({TopicPartition(t, p): spec for t, p in parts},
                                         request_timeout=self.timeout)
            return {(tp.topic, tp.partition): int(f.result(self.timeout * 2).offset)
                    for tp, f in futures.items()}

        return (offsets(OffsetSpec.earliest()),  # type: ignore[no-untyped-call]
                offsets(OffsetSpec.latest()))  # type: ignore[no-untyped-call]

    def _read(self, group: str, partitions: Sequence[tuple[str, int]]) -> list[PartitionLag]:
        if not partitions:
            return []
        committed = self._committed(group, partitions)
        low, high = self._watermarks(partitions)
        return [_row(group, tp, committed, low, high) for tp in partitions]

    def _read_groups(self, groups: Mapping[str, Sequence[str]], committed_only: bool
                     ) -> list[PartitionLag]:
        known = self._topics()
        wanted = {g: [(t, p) for t in names for p in known.get(t, [])]
                  for g, names in groups.items()}
        committed = {g: self._committed(g, parts) for g, parts in wanted.items() if parts}
        if committed_only:
            kept = {g: {t for (t, _p), offset in committed[g].items() if offset >= 0}
                    for g in committed}
            wanted = {g: [(t, p) for t, p in parts if t in kept.get(g, set())]
                      for g, parts in wanted.items()}
        low, high = self._watermarks(tp for parts in wanted.values() for tp in parts)
        return [_row(g, tp, committed.get(g, {}), low, high)
                for g, parts in sorted(wanted.items()) for tp in parts]


def _row(group: str, tp: tuple[str, int], committed: Mapping[tuple[str, int], int],
         low: Mapping[tuple[str, int], int], high: Mapping[tuple[str, int], int]
         ) -> PartitionLag:
    done = committed.get(tp, -1)
    return PartitionLag(group, tp[0], tp[1], start_offset=low.get(tp, 0),
                        end_offset=high.get(tp, 0), committed_offset=done if done >= 0 else None)
