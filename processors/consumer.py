"""The parallel consumer: one thread owns the confluent-kafka Consumer; work runs elsewhere.

The thread polls, hands batches to the asyncio side, commits the contiguous completed
prefix of each partition every ``commit_interval``, and pauses (rather than stops polling)
when in-flight work reaches its bound, so the consumer stays in its group however long the
model calls take.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from processors.offsets import OffsetTracker

__all__ = ["ParallelConsumer"]

log = logging.getLogger(__name__)


class ParallelConsumer:
    def __init__(
        self,
        config: dict[str, object],
        topics: list[str],
        deliver: Callable[[list[Message]], None],
        *,
        max_in_flight: int,
        commit_interval: float = 0.2,
        batch_size: int = 500,
    ) -> None:
        self.config = config
        self.topics = topics
        self.deliver = deliver
        self.max_in_flight = max_in_flight
        self.commit_interval = commit_interval
        self.batch_size = batch_size
        self.tracker = OffsetTracker()
        self._assigned: set[tuple[str, int]] = set()
        self._paused = False
        self._consumer: Consumer | None = None
        self.ready = threading.Event()  # set once the first assignment arrived

    # -- rebalance callbacks (run inside poll, on the consumer thread) --------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            key = (tp.topic, tp.partition)
            self._assigned.add(key)
            self.tracker.assign(key)
        if self._paused and partitions:
            consumer.pause(partitions)
        self.ready.set()

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        keys = {(tp.topic, tp.partition) for tp in partitions}
        self._commit(consumer, only=keys)  # commit the completed prefix before letting go
        for key in keys:
            self._assigned.discard(key)
            self.tracker.revoke(key)

    def _on_lost(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost, not revoked: another member may own them already, so commit nothing.
        for tp in partitions:
            key = (tp.topic, tp.partition)
            self._assigned.discard(key)
            self.tracker.revoke(key)

    # -- the loop --------------------------------------------------------------------------

    def _commit(self, consumer: Consumer, only: set[tuple[str, int]] | None = None) -> None:
        positions = self.tracker.to_commit(only)
        if not positions:
            return
        try:
            consumer.commit(
                offsets=[TopicPartition(t, p, o) for (t, p), o in positions.items()],
                asynchronous=False,
            )
            self.tracker.committed(positions)
        except KafkaException as exc:
            # Not fatal: the same prefix (or a longer one) is committed next interval.
            log.warning("offset commit failed: %s", exc)

    def _backpressure(self, consumer: Consumer) -> None:
        in_flight = self.tracker.in_flight()
        parts = [TopicPartition(t, p) for t, p in self._assigned]
        if not self._paused and in_flight >= self.max_in_flight:
            consumer.pause(parts)
            self._paused = True
        elif self._paused and in_flight <= self.max_in_flight * 0.8:
            consumer.resume(parts)
            self._paused = False

    def run(self, stop: threading.Event, drained: Callable[[], bool]) -> None:
        """Poll until ``stop``; then wait for ``drained()``, commit, and leave the group."""
        consumer = Consumer(self.config)
        self._consumer = consumer
        consumer.subscribe(
            self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        last_commit = time.monotonic()
        try:
            while not stop.is_set():
                self._backpressure(consumer)
                messages = consumer.consume(self.batch_size, timeout=0.05)
                batch: list[Message] = []
                for msg in messages:
                    err = msg.error()
                    if err is not None:
                        if err.code() != KafkaError._PARTITION_EOF:
                            log.warning("consumer error: %s", err)
                        continue
                    self.tracker.add((msg.topic(), msg.partition()), msg.offset())
                    batch.append(msg)
                if batch:
                    self.deliver(batch)
                now = time.monotonic()
                if now - last_commit >= self.commit_interval:
                    self._commit(consumer)
                    last_commit = now
            # Graceful stop: fetch nothing new, keep the membership alive while work drains.
            consumer.pause([TopicPartition(t, p) for t, p in self._assigned])
            while not drained():
                consumer.poll(0.05)
                self._commit(consumer)
            self._commit(consumer)
        finally:
            consumer.close()
