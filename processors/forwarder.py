"""The retry forwarder: holds each ``calmq.retry.<tier>`` partition until its head is due,
then republishes the message to the topic it came from and commits.

A retry message carries ``calmq-origin-topic`` (where it goes back to) and ``calmq-due-at``
(epoch ms). Messages of one tier are written with delays no longer than the tier's, so a
message held behind a later-due head is still released within its tier's delay.

Holding is a pause, never a sleep: the partition is paused and rewound to its head, a
timer (the ``resume_at`` map checked on every poll) resumes it when the head is due, and
the consumer keeps polling meanwhile so it stays in its group. An offset is committed only
after Kafka acknowledged the republished copy, so a crash republishes at most again (the
worker acknowledges a duplicate of a job it finished without calling the model). A copy
Kafka refused is republished in-process after the kernel's jittered backoff
(``calmq.retrying``), so one failed delivery does not stall the partition's commits until a
restart.

Anyone who can write to a retry topic controls those two headers, so neither is trusted:
an origin that is not a work topic (``calmq.<pool>.<priority>``: never the results, the
dead letters or a retry tier) or that does not exist goes to ``calmq.dlq``, and a due time
further ahead than its tier's delay (calmq never writes one: a tier only gets delays up to
its own) is held only that long, so one message cannot hold a partition's head for good.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Callable

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from calmq import events, topics
from calmq.codec import EventCodec
from calmq.errors import ConfigError
from calmq.kafka import header, produce
from calmq.processors import metrics
from calmq.processors.offsets import OffsetTracker, commit_prefix, headers_of, position_of
from calmq.retrying import Reconnect
from calmq.settings import parse_duration
from calmq.supervision import Lifecycle

__all__ = ["DUE_AT", "ORIGIN", "Forwarder", "ForwarderService"]

log = logging.getLogger(__name__)

ORIGIN = "calmq-origin-topic"
DUE_AT = "calmq-due-at"
_FORWARDED_FROM = "calmq-forwarded-from"
_MAX_WAIT = 0.1  # longest poll: bounds how late a timer fires and how fast stop is noticed
# calmq.<pool>.<interactive|bulk>: the only topics a retry goes back to.
# The batch lane's topic is a work topic too: a batched request that failed transiently
# goes back to it, into a later provider batch.
_WORK_TOPIC = r"[A-Za-z0-9_-]+\.(?:interactive|bulk|" + topics.BATCH + ")"


def _is_work_topic(topic: str) -> bool:
    # topics.PREFIX read per call: it carries this process's name prefix (topics.configure).
    return re.fullmatch(re.escape(topics.PREFIX) + _WORK_TOPIC, topic) is not None


_MISSING_TTL = 10.0  # a topic found missing is looked up again after this long
_CLOCK_SLACK = 5.0  # seconds a due time may run past its tier (writers' clocks differ)


class Forwarder:
    def __init__(
        self,
        consumer_config: dict[str, object],
        producer: Producer,
        codec: EventCodec,
        tier_topics: list[str],
        *,
        commit_interval: float = 0.2,
        batch_size: int = 500,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.consumer_config = consumer_config
        self.producer = producer
        self.codec = codec
        self.tier_topics = tier_topics
        self.commit_interval = commit_interval
        self.batch_size = batch_size
        self.clock = clock
        self.tracker = OffsetTracker()
        self.resume_at: dict[tuple[str, int], float] = {}  # paused partition -> head due (s)
        self.forwarded = 0
        self.ready = threading.Event()
        # Copies Kafka refused, each with the time (self.clock) to republish it again; the
        # offset stays in the tracker, not done, so nothing past it is committed meanwhile.
        self.again: list[tuple[float, Message]] = []
        self._refused = Reconnect("republishing a retry message failed")
        # The longest hold a due time may ask for, per tier topic: the tier's own delay (calmq
        # writes no longer delay into a tier) plus slack for clocks that disagree.
        self.max_hold = {t: _tier_seconds(t) + _CLOCK_SLACK for t in tier_topics}
        # Heads due past their tier: when first seen (their hold runs from then).
        self._overdue: dict[tuple[tuple[str, int], int], float] = {}
        self._topics: set[str] = set()  # origins seen in the broker's metadata
        self._missing: dict[str, float] = {}  # origin -> when it was found missing

    # -- rebalance callbacks ----------------------------------------------------------------

    def _on_assign(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            self.tracker.assign((tp.topic, tp.partition))
        self.ready.set()

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Everything handed to the producer must be acknowledged before its offset is
        # committed and the partition let go.
        self.producer.flush(30)
        keys = {(tp.topic, tp.partition) for tp in partitions}
        self._commit(consumer, only=keys)
        for key in keys:
            self.tracker.revoke(key)
            self.resume_at.pop(key, None)
        self._forget(keys)

    def _on_lost(self, _consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            key = (tp.topic, tp.partition)
            self.tracker.revoke(key)
            self.resume_at.pop(key, None)
        self._forget({(tp.topic, tp.partition) for tp in partitions})

    def _forget(self, keys: set[tuple[str, int]]) -> None:
        # Not ours any more: the partition's next owner reads the message again.
        self.again = [(at, m) for at, m in self.again if position_of(m)[0] not in keys]
        self._overdue = {k: v for k, v in self._overdue.items() if k[0] not in keys}

    # -- the loop ---------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        consumer = Consumer(self.consumer_config)
        consumer.subscribe(self.tier_topics, on_assign=self._on_assign,
                           on_revoke=self._on_revoke, on_lost=self._on_lost)
        last_commit = time.monotonic()
        try:
            while not stop.is_set():
                self._resume_due(consumer)
                self._republish_due()
                messages = consumer.consume(self.batch_size, timeout=self._wait())
                self._handle(consumer, messages)
                self.producer.poll(0)  # serve delivery reports: they complete offsets
                now = time.monotonic()
                if now - last_commit >= self.commit_interval:
                    self._commit(consumer)
                    last_commit = now
            self.producer.flush(30)
            self._commit(consumer)
        finally:
            consumer.close()

    def _wait(self) -> float:
        timers = [*self.resume_at.values(), *(at for at, _m in self.again)]
        if not timers:
            return _MAX_WAIT
        return max(0.0, min(_MAX_WAIT, min(timers) - self.clock()))

    def _republish_due(self) -> None:
        if not self.again:
            return
        now = self.clock()
        due = [m for at, m in self.again if at <= now]
        self.again = [(at, m) for at, m in self.again if at > now]
        for msg in due:
            self._forward(msg)

    def _resume_due(self, consumer: Consumer) -> None:
        now = self.clock()
        due = [tp for tp, at in self.resume_at.items() if at <= now]
        if due:
            consumer.resume([TopicPartition(t, p) for t, p in due])
            for tp in due:
                del self.resume_at[tp]

    def _handle(self, consumer: Consumer, messages: list[Message]) -> None:
        now = self.clock()
        for msg in messages:
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    log.warning("consumer error: %s", err)
                continue
            tp, offset = position_of(msg)
            if tp in self.resume_at:
                continue  # the rest of a partition held in this batch: fetched again later
            due = _due_seconds(msg)
            hold = self.max_hold.get(tp[0], 3600.0 + _CLOCK_SLACK)
            if due is not None and due > now + hold:
                # Held from when it was first seen, so the head is let go once that ran out
                # (measured from "now" it would be held again at every resume).
                first = self._overdue.setdefault((tp, offset), now)
                if first == now:
                    log.warning("%s[%d]@%d is due %.0f s ahead, past its tier: held %.0f s "
                                "at most", *tp, offset, due - now, hold)
                due = first + hold
            if due is not None and due > now:
                # Hold: rewind to this head, pause, and let the timer resume at its due time.
                part = TopicPartition(tp[0], tp[1], offset)
                consumer.pause([part])
                consumer.seek(part)
                self.resume_at[tp] = due
                metrics.FORWARDER_HELD.set(len(self.resume_at))
                continue
            self._overdue.pop((tp, offset), None)
            self.tracker.add(tp, offset)
            self._forward(msg)
        metrics.FORWARDER_HELD.set(len(self.resume_at))

    def _forward(self, msg: Message) -> None:
        tp, offset = position_of(msg)
        raw_headers = headers_of(msg)
        origin = header(raw_headers, ORIGIN)

        def acked(err: KafkaError | None, _m: Message) -> None:
            if err is None:
                self.tracker.done(tp, offset)
                self.forwarded += 1
                metrics.FORWARDED.inc()
                self._refused.succeeded()
            else:
                # Not done, so not committed: republished here after a jittered pause (and,
                # should this process die first, by the partition's next owner).
                log.error("republishing %s[%d]@%d failed: %s", *tp, offset, err)
                self.again.append((self.clock() + self._refused.failed(), msg))

        refusal = self._refusal(origin)
        if refusal is not None:
            code, reason = refusal
            value = self.codec.encode("job.dead_lettered", events.dead_lettered(
                None,
                errors=[{"attempt": 0, "code": code, "class": "input", "message": reason}],
                source_topic=tp[0],
                raw_value=msg.value(),
            ) | {"raw_value": msg.value()})
            metrics.POISON.inc()
            produce(self.producer, topics.DLQ, msg.key(), value,
                    headers=[("calmq-error-code", code.encode())], on_delivery=acked)
            return
        assert origin is not None  # _refusal refuses a missing origin
        kept: list[tuple[str, str | bytes | None]] = [
            (k, v) for k, v in raw_headers if k not in (ORIGIN, DUE_AT, _FORWARDED_FROM)]
        kept.append((_FORWARDED_FROM, tp[0].encode()))
        produce(self.producer, origin, msg.key(), msg.value(), headers=kept, on_delivery=acked)

    def _refusal(self, origin: str | None) -> tuple[str, str] | None:
        """Why a retry cannot go back to ``origin`` (code, message), or None if it can."""
        if not origin or not _is_work_topic(origin):
            return ("missing_origin_topic",
                    f"retry message without a usable {ORIGIN} header ({origin!r}): a retry "
                    "goes back to a work topic calmq.<pool>.<interactive|bulk|batch>")
        if origin in self._topics:
            return None
        missing_since = self._missing.get(origin)
        if missing_since is None or time.monotonic() - missing_since > _MISSING_TTL:
            try:
                meta = self.producer.list_topics(origin, timeout=5)
            except KafkaException:
                return None  # the broker did not answer: try to produce; a refusal retries
            found = meta.topics.get(origin)
            if found is not None and found.error is None and found.partitions:
                self._topics.add(origin)
                self._missing.pop(origin, None)
                return None
            self._missing[origin] = time.monotonic()
        return ("unknown_topic", f"the retry's origin topic {origin} does not exist: create "
                "the pool's topics (`calmq topics create --pool <pool>`)")

    def _commit(self, consumer: Consumer, only: set[tuple[str, int]] | None = None) -> None:
        commit_prefix(consumer, self.tracker, only)


class ForwarderService:
    """`calmq forwarder` under the processors' one lifecycle (calmq.supervision): the
    forwarder's thread is its critical side task (a forwarder that stopped polling would hold
    its partitions and forward nothing), and a stop lets it flush and commit first."""

    name = "forwarder"

    def __init__(self, forwarder: Forwarder, *, grace_seconds: float = 30.0) -> None:
        self.forwarder = forwarder
        self.life = Lifecycle(self, grace_seconds=grace_seconds)
        self._running: asyncio.Task[None] | None = None

    async def run(self) -> None:
        await self.life.run()

    async def start(self, life: Lifecycle) -> None:
        self._running = life.side.spawn(
            "retry-forwarder", lambda: asyncio.to_thread(self.forwarder.run, life.stop),
            critical=True)

    async def tick(self) -> None:
        return None

    async def drain(self, grace_seconds: float) -> None:
        if self._running is not None:  # it flushes its producer and commits, then returns
            await asyncio.wait([self._running], timeout=grace_seconds + 30)

    async def close(self) -> None:
        return None


def _tier_seconds(topic: str) -> float:
    try:
        return parse_duration(
            topic.removeprefix(topics.topic_for_route(topics.retry_route(""))))
    except ConfigError:
        return 3600.0  # not a tier name calmq makes: assume the default longest tier


def _due_seconds(msg: Message) -> float | None:
    raw = header(headers_of(msg), DUE_AT)
    if raw is None:
        return None
    try:
        return int(raw) / 1000
    except ValueError:
        return None  # unreadable due time: forward now rather than hold forever
