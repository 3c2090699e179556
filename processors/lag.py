"""Consumer lag, sampled off the poll loop with a Kafka client of its own.

Reading lag costs broker round trips: the group's committed offsets and each partition's
high watermark. Asked through the consumer itself they ran on the consumer thread, one
ListOffsets round trip per partition, and held up polling — measured at 500 jobs/s, about
0.7 s every 5 s with 16 partitions, which every job fetched meanwhile waited out. Clients
of the sampler's own (an admin client for the watermarks, a consumer that never joins the
group for its committed offsets) ask for all partitions in one request each and never touch
the poll loop. The
worker runs ``sample`` in a thread every ``consumer_lag_interval_seconds``, as one of its
side tasks (calmq.supervision).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]

from calmq.kafka import connection_of
from calmq.processors import metrics

__all__ = ["LagSampler", "admin_config"]

def admin_config(consumer_config: dict[str, Any]) -> dict[str, Any]:
    """Client settings an admin client shares with the consumer: where the brokers are and
    how to reach them (security, ``CALMQ_KAFKA_CONFIG``'s properties, an ``oauth_cb``).
    Group and fetch settings are the consumer's own."""
    return connection_of(consumer_config)


class LagSampler:
    """Sets ``calmq_consumer_lag_messages`` per topic: high watermark minus the group's
    committed offset, summed over the partitions this worker owns (``owned()``); a
    partition never committed counts from its low watermark."""

    def __init__(self, consumer_config: dict[str, Any], topics: Sequence[str],
                 owned: Callable[[], Sequence[tuple[str, int]]],
                 timeout: float = 5.0) -> None:
        self.group = str(consumer_config["group.id"])
        self.admin_config = admin_config(consumer_config)
        self.topics = list(topics)
        self.owned = owned
        self.timeout = timeout
        self._committed_reader: Consumer | None = None

    def sample(self, admin: AdminClient) -> dict[str, int]:
        """Read the lag once (blocking: a few broker round trips) and set the gauge."""
        owned = sorted(self.owned())
        lag: dict[str, int] = dict.fromkeys(self.topics, 0)
        if owned:
            parts = [TopicPartition(t, p) for t, p in owned]
            # Not admin.list_consumer_group_offsets: when the broker goes away, a timed-out
            # group request of the admin client aborts the whole process in librdkafka
            # (assertion `eonce->refcnt > 0`, confluentinc/librdkafka#4605, open; both
            # workers died in the chaos test's Kafka restart). A consumer's committed() is
            # one OffsetFetch for all partitions too, and fails with a timeout instead.
            reply = self._reader().committed(parts, timeout=self.timeout)
            committed = {(tp.topic, tp.partition): tp.offset for tp in reply}
            high = self._offsets(admin, owned, OffsetSpec.latest())  # type: ignore[no-untyped-call]
            never = [tp for tp in owned if committed.get(tp, -1) < 0]
            low = (self._offsets(admin, never, OffsetSpec.earliest())  # type: ignore[no-untyped-call]
                   if never else {})
            for tp in owned:
                start = committed.get(tp, -1)
                if start < 0:
                    start = low.get(tp, 0)
                lag[tp[0]] = lag.get(tp[0], 0) + max(0, high.get(tp, 0) - start)
        for topic, value in lag.items():
            metrics.CONSUMER_LAG.labels(topic).set(value)
        return lag

    def _reader(self) -> Consumer:
        """A consumer of the group that never subscribes (so never joins it): it only reads
        the group's committed offsets."""
        if self._committed_reader is None:
            self._committed_reader = Consumer({**self.admin_config, "group.id": self.group,
                                               "enable.auto.commit": False})
        return self._committed_reader

    def _offsets(self, admin: AdminClient, parts: Sequence[tuple[str, int]],
                 spec: OffsetSpec) -> dict[tuple[str, int], int]:
        futures = admin.list_offsets({TopicPartition(t, p): spec for t, p in parts},
                                     request_timeout=self.timeout)
        return {(tp.topic, tp.partition): f.result(self.timeout * 2).offset
                for tp, f in futures.items()}
