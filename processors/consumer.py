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

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from calmq.jobs import Priority
from calmq.processors import metrics
from calmq.processors.offsets import OffsetTracker, commit_prefix, position_of

__all__ = ["ParallelConsumer"]

log = logging.getLogger(__name__)


class ParallelConsumer:
    def __init__(
        self,
        config: dict[str, object],
        topics: list[str],
        deliver: Callable[[list[Message]], object],
        *,
        max_in_flight: int,
        commit_interval: float = 0.2,
        batch_size: int = 500,
        interactive_reserve: int | None = None,
        settling: Callable[[], int] | None = None,
        read_ahead: int = 0,
    ) -> None:
        self.config = config
        # Messages fetched past the bound: with fair share on, admission holds in the
        # waiting room what finds no free slot (acknowledging it), so reading on while the
        # slots are full is how a small tenant's job behind a backlog is seen at once.
        self.read_ahead = read_ahead
        # Messages whose attempt ended and whose outcome is being written: they hold no
        # model call any more, so they do not count against the bound (up to another
        # bound's worth), or a slow group commit would leave call slots idle.
        self.settling = settling or (lambda: 0)
        self.topics = topics
        self.deliver = deliver
        self.max_in_flight = max_in_flight
        self.commit_interval = commit_interval
        self.batch_size = batch_size
        self.tracker = OffsetTracker()
        self._assigned: set[tuple[str, int]] = set()
        # What the lag sampler reads from another thread: replaced whole, never in place.
        self._owned: tuple[tuple[str, int], ...] = ()
        self._paused_kinds: set[str] = set()  # the priorities paused
        # Interactive work may exceed the bound by this much, so it is fetched ahead of bulk
        # when the process is full of bulk work.
        self.reserve = max(1, max_in_flight // 8) if interactive_reserve is None \
            else interactive_reserve
        self._consumer: Consumer | None = None
        self.ready = threading.Event()  # set once the first assignment arrived

    @property
    def owned(self) -> tuple[tuple[str, int], ...]:
        """The partitions assigned to this consumer; safe to read from another thread."""
        return self._owned

    # -- rebalance callbacks (run inside poll, on the consumer thread) --------------------

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            key = (tp.topic, tp.partition)
            self._assigned.add(key)
            self.tracker.assign(key)
        self._owned = tuple(self._assigned)
        held = [tp for tp in partitions if self._kind(tp.topic) in self._paused_kinds]
        if held:
            consumer.pause(held)
        self.ready.set()

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        keys = {(tp.topic, tp.partition) for tp in partitions}
        self._commit(consumer, only=keys)  # commit the completed prefix before letting go
        for key in keys:
            self._assigned.discard(key)
            self.tracker.revoke(key)
        self._owned = tuple(self._assigned)

    def _on_lost(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Lost, not revoked: another member may own them already, so commit nothing.
        for tp in partitions:
            key = (tp.topic, tp.partition)
            self._assigned.discard(key)
            self.tracker.revoke(key)
        self._owned = tuple(self._assigned)

    # -- the loop --------------------------------------------------------------------------

    def _commit(self, consumer: Consumer, only: set[tuple[str, int]] | None = None, *,
                asynchronous: bool = False) -> None:
        self._observe_commit_lag(
            commit_prefix(consumer, self.tracker, only, asynchronous=asynchronous))

    def _on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        """An asynchronous commit's answer (served inside poll, on the consumer thread)."""
        if err is not None:  # nothing of it is known committed; the next commit retries
            if err.code() != KafkaError._NO_OFFSET:
                log.warning("offset commit failed: %s", err)
            return
        done = {(tp.topic, tp.partition): tp.offset for tp in partitions
                if tp.error is None and tp.offset >= 0}
        if done:
            self._observe_commit_lag(self.tracker.committed(done))

    @staticmethod
    def _observe_commit_lag(lag: float | None) -> None:
        if lag is not None:
            metrics.COMMIT_LAG.observe(lag)
            metrics.COMMIT_LAG_LAST.set(lag)

    def _room(self) -> tuple[int, int]:
        """Free slots for (bulk, interactive): interactive may also use the reserve."""
        pending = self.tracker.in_flight()
        in_flight = max(pending - self.settling(), pending - self.max_in_flight)
        bound = self.max_in_flight + self.read_ahead
        return bound - in_flight, bound + self.reserve - in_flight

    def _backpressure(self, consumer: Consumer) -> int:
        """Pause what may not fetch now, resume what may; returns how many to consume.

        Bulk partitions pause at the bound, interactive ones only once the interactive
        reserve is used too, so interactive work is fetched ahead of bulk while the process
        is full. A paused partition resumes once a slice of room is free again (hysteresis
        keeps a full process from flapping on every completion).
        """
        bulk_room, interactive_room = self._room()
        slack = max(1, min(self.batch_size, self.max_in_flight // 20))
        for kind, room in ((Priority.BULK, bulk_room), (Priority.INTERACTIVE, interactive_room)):
            parts = [tp for tp in self._assigned if self._kind(tp[0]) == kind]
            if not parts:
                continue
            if kind not in self._paused_kinds and room <= 0:
                consumer.pause([TopicPartition(t, p) for t, p in parts])
                self._paused_kinds.add(kind)
            elif kind in self._paused_kinds and room >= slack:
                consumer.resume([TopicPartition(t, p) for t, p in parts])
                self._paused_kinds.discard(kind)
        room = interactive_room if Priority.BULK in self._paused_kinds else bulk_room
        return max(0, min(self.batch_size, room))

    @staticmethod
    def _kind(topic: str) -> str:
        return Priority.BULK if topic.endswith(f".{Priority.BULK}") else Priority.INTERACTIVE

    def run(self, stop: threading.Event, drained: Callable[[], bool]) -> None:
        """Poll until ``stop``; then wait for ``drained()``, commit, and leave the group."""
        consumer = Consumer({**self.config, "on_commit": self._on_commit})
        self._consumer = consumer
        consumer.subscribe(
            self.topics, on_assign=self._on_assign, on_revoke=self._on_revoke,
            on_lost=self._on_lost,
        )
        last_commit = time.monotonic()
        try:
            while not stop.is_set():
                room = self._backpressure(consumer)
                # Full: every partition is paused, so this only serves the group
                # (heartbeats, rebalances) and returns nothing. Otherwise wait for the first
                # message only, then take what else is fetched already: consume(n, timeout)
                # holds a batch until n arrive or the timeout passes, which added up to
                # 50 ms to every job's dispatch at moderate rates. The stages batch the
                # claims of what arrives while they claim (processors/pipeline.py, submit).
                first = consumer.poll(0.05)
                messages: list[Message] = [] if first is None else [first]
                if first is not None and room > 1:
                    messages += consumer.consume(room - 1, timeout=0)
                batch: list[Message] = []
                for msg in messages:
                    err = msg.error()
                    if err is not None:
                        if err.code() != KafkaError._PARTITION_EOF:
                            log.warning("consumer error: %s", err)
                        continue
                    self.tracker.add(*position_of(msg))
                    batch.append(msg)
                if batch:
                    self.deliver(batch)
                now = time.monotonic()
                if now - last_commit >= self.commit_interval:
                    # Asynchronous: a synchronous commit held polling for a broker round
                    # trip five times a second. Revoke and shutdown still wait for theirs.
                    self._commit(consumer, asynchronous=True)
                    last_commit = now
            # Graceful stop: fetch nothing new, keep the membership alive while work drains.
            consumer.pause([TopicPartition(t, p) for t, p in self._assigned])
            self._paused_kinds = {p.value for p in Priority}
            while not drained():
                consumer.poll(0.05)
                self._commit(consumer)
            self._commit(consumer)
        finally:
            consumer.close()
