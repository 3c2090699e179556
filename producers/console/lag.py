"""Consumer lag per topic and group for the console's overview, read by the API process.

The workers' own sampler (processors/lag.py) sees only the partitions each worker owns; the
overview wants the fleet's view: for every calmq consumer group (``calmq.<pool>``,
``calmq.forwarder``) the messages of each topic it has not committed yet (high watermark
minus committed offset; a partition of the topic it never committed counts from its low
watermark). Read with an admin client, as processors/lag.py does: one request per group
for its committed offsets, one for all watermarks, and no group membership, so reading
never rebalances a worker.

The client blocks on broker round trips, so a read runs in a thread, at most one at a time,
and its answer is kept for ``ttl`` seconds: page views share it and never block the event
loop. Every request has a timeout, and a broker that does not answer in time gives
``None`` ("lag unavailable" on the page), never an error page.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from confluent_kafka import ConsumerGroupTopicPartitions, TopicPartition
from confluent_kafka.admin import AdminClient, OffsetSpec  # type: ignore[attr-defined]

from calmq import topics

if TYPE_CHECKING:
    from calmq.settings import Settings

__all__ = ["ConsumerLag", "TopicLag"]

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class TopicLag:
    group: str
    topic: str
    lag: int  # messages not yet committed by the group, over the topic's partitions
    partitions: int


class ConsumerLag:
    def __init__(self, *, ttl: float = 5.0, timeout: float = 3.0,
                 group_prefix: str = topics.PREFIX) -> None:
        self.ttl = ttl
        self.timeout = timeout
        self.group_prefix = group_prefix
        self._admin: AdminClient | None = None
        self._settings: Settings | None = None
        self._value: list[TopicLag] | None = None
        self._at = -float("inf")
        self._lock = asyncio.Lock()

    async def read(self, settings: Settings) -> list[TopicLag] | None:
        """The lag per group and topic (at most ``ttl`` seconds old), None: unavailable."""
        if time.monotonic() - self._at < self.ttl:
            return self._value
        async with self._lock:
            if time.monotonic() - self._at < self.ttl:  # read while this one waited
                return self._value
            try:
                # The admin calls carry their own timeouts; this bounds the whole read.
                value: list[TopicLag] | None = await asyncio.wait_for(
                    asyncio.to_thread(self._read, settings), self.timeout * 4)
            except Exception as exc:  # noqa: BLE001 - any broker failure: "unavailable"
                log.warning("reading consumer lag failed: %s", exc)
                value = None
            self._value, self._at = value, time.monotonic()
        return value

    def _client(self, settings: Settings) -> AdminClient:
        if self._admin is None or settings is not self._settings:
            from calmq.kafka import connection_config

            # The process's Kafka settings (security, pass-through), as every client has.
            self._admin = AdminClient({**connection_config(settings),
                                       "socket.timeout.ms": int(self.timeout * 1000)})
            self._settings = settings
        return self._admin

    def _read(self, settings: Settings) -> list[TopicLag]:
        admin = self._client(settings)
        t = self.timeout
        # Metadata first: with no broker answering it raises (listing groups would instead
        # answer an empty list, which would read as "no lag").
        metadata = admin.list_topics(timeout=t)
        listed = admin.list_consumer_groups(request_timeout=t).result(t * 2)
        if listed.errors:
            raise listed.errors[0]
        groups = sorted(g.group_id for g in listed.valid
                        if str(g.group_id).startswith(self.group_prefix))
        committed: dict[tuple[str, str, int], int] = {}
        for group in groups:
            reply = admin.list_consumer_group_offsets(
                [ConsumerGroupTopicPartitions(group)], request_timeout=t)[group].result(t * 2)
            for tp in reply.topic_partitions or []:
                committed[(group, tp.topic, tp.partition)] = tp.offset
        if not committed:
            return []
        partitions: dict[tuple[str, str], list[int]] = {}
        for group, topic, _p in committed:
            known = metadata.topics.get(topic)
            if known is not None:
                partitions[(group, topic)] = sorted(known.partitions)
        wanted = {(topic, p) for (_g, topic), ps in partitions.items() for p in ps}
        high = self._offsets(admin, wanted, OffsetSpec.latest())  # type: ignore[no-untyped-call]
        never = {(topic, p) for (group, topic), ps in partitions.items() for p in ps
                 if committed.get((group, topic, p), -1) < 0}
        low = (self._offsets(admin, never, OffsetSpec.earliest())  # type: ignore[no-untyped-call]
               if never else {})
        out = []
        for (group, topic), ps in sorted(partitions.items()):
            behind = 0
            for p in ps:
                start = committed.get((group, topic, p), -1)
                if start < 0:
                    start = low.get((topic, p), 0)
                behind += max(0, high.get((topic, p), 0) - start)
            out.append(TopicLag(group, topic, behind, len(ps)))
        return out

    def _offsets(self, admin: AdminClient, parts: set[tuple[str, int]],
                 spec: Any) -> dict[tuple[str, int], int]:
        if not parts:
            return {}
        futures = admin.list_offsets({TopicPartition(t, p): spec for t, p in sorted(parts)},
                                     request_timeout=self.timeout)
        return {(tp.topic, tp.partition): f.result(self.timeout * 2).offset
                for tp, f in futures.items()}
