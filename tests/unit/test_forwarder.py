"""The retry forwarder holds a partition (pause + rewind) until its head is due, then
republishes to the origin topic and completes the offset only once Kafka acknowledged."""

from __future__ import annotations

import json
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from calmq.codec import SingleObjectCodec
from calmq.processors.forwarder import DUE_AT, ORIGIN, Forwarder

RETRY = "calmq.retry.5s"


class Msg:
    """The part of confluent_kafka.Message the forwarder reads."""

    def __init__(self, offset: int, due_ms: int | None, origin: str | None = "calmq.p.bulk"):
        self._offset = offset
        self._headers = [("id", b"e1")]
        if origin is not None:
            self._headers.append((ORIGIN, origin.encode()))
        if due_ms is not None:
            self._headers.append((DUE_AT, str(due_ms).encode()))

    def error(self) -> None:
        return None

    def topic(self) -> str:
        return RETRY

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self._offset

    def key(self) -> bytes:
        return b"job-1"

    def value(self) -> bytes:
        return b"avro bytes"

    def headers(self) -> list[tuple[str, bytes]]:
        return self._headers


class FakeConsumer:
    def __init__(self) -> None:
        self.paused: set[tuple[str, int]] = set()
        self.seeks: list[tuple[str, int, int]] = []

    def pause(self, parts: list[TopicPartition]) -> None:
        self.paused |= {(p.topic, p.partition) for p in parts}

    def resume(self, parts: list[TopicPartition]) -> None:
        self.paused -= {(p.topic, p.partition) for p in parts}

    def seek(self, part: TopicPartition) -> None:
        self.seeks.append((part.topic, part.partition, part.offset))


class _TopicMeta:
    def __init__(self, exists: bool) -> None:
        self.error = None if exists else "UNKNOWN_TOPIC_OR_PART"
        self.partitions = {0: object()} if exists else {}


class _ClusterMeta:
    def __init__(self, topics: dict[str, _TopicMeta]) -> None:
        self.topics = topics


class FakeProducer:
    """The Producer methods the forwarder calls; ``existing`` are the broker's topics."""

    def __init__(self, existing: tuple[str, ...] = ("calmq.p.bulk", "calmq.p.interactive")
                 ) -> None:
        self.sent: list[dict[str, Any]] = []
        self.existing = set(existing)

    def list_topics(self, topic: str, timeout: float = -1) -> _ClusterMeta:
        return _ClusterMeta({topic: _TopicMeta(topic in self.existing)})

    def produce(self, topic: str, **kw: Any) -> None:
        self.sent.append({"topic": topic, **kw})

    def ack_all(self) -> None:
        for record in self.sent:
            record["on_delivery"](None, None)


def _forwarder(now: list[float]) -> tuple[Forwarder, FakeConsumer, FakeProducer]:
    producer = FakeProducer()
    fwd = Forwarder({}, producer, SingleObjectCodec(), [RETRY],  # type: ignore[arg-type]
                    clock=lambda: now[0])
    fwd.tracker.assign((RETRY, 0))
    return fwd, FakeConsumer(), producer


def test_head_not_due_pauses_and_rewinds_the_partition() -> None:
    """A head due in the future pauses its partition at that offset; nothing is sent."""
    now = [1000.0]
    fwd, consumer, producer = _forwarder(now)
    fwd._handle(consumer, [Msg(7, 1_005_000), Msg(8, 1_001_000)])  # type: ignore[arg-type, list-item]
    assert consumer.paused == {(RETRY, 0)}
    assert consumer.seeks == [(RETRY, 0, 7)]
    assert fwd.resume_at == {(RETRY, 0): 1005.0}
    assert producer.sent == []
    assert fwd._wait() == 0.1  # polls on (short), does not sleep until due
    now[0] = 1005.0
    fwd._resume_due(consumer)  # type: ignore[arg-type]
    assert consumer.paused == set()
    assert fwd.resume_at == {}


def test_due_message_goes_back_to_its_origin_and_commits_after_ack() -> None:
    """A due message is republished to calmq-origin-topic without the retry headers; its
    offset becomes committable only after the delivery report."""
    now = [1000.0]
    fwd, consumer, producer = _forwarder(now)
    fwd.tracker.committed({(RETRY, 0): 3})
    fwd._handle(consumer, [Msg(3, 999_000)])  # type: ignore[arg-type, list-item]
    (record,) = producer.sent
    assert record["topic"] == "calmq.p.bulk"
    assert record["key"] == b"job-1"
    names = [k for k, _v in record["headers"]]
    assert ORIGIN not in names
    assert DUE_AT not in names
    assert ("calmq-forwarded-from", RETRY.encode()) in record["headers"]
    assert fwd.tracker.to_commit() == {}  # sent, not acknowledged
    producer.ack_all()
    assert fwd.tracker.to_commit() == {(RETRY, 0): 4}


def test_message_without_origin_goes_to_the_dlq() -> None:
    """A retry message with no origin header is dead-lettered, never forwarded in a loop."""
    fwd, consumer, producer = _forwarder([1000.0])
    fwd._handle(consumer, [Msg(0, None, origin=None)])  # type: ignore[arg-type, list-item]
    (record,) = producer.sent
    assert record["topic"] == "calmq.dlq"
    assert ("calmq-error-code", b"missing_origin_topic") in record["headers"]


def test_a_refused_republish_is_sent_again_after_a_backoff_and_then_commits() -> None:
    """A copy Kafka refused is republished in-process after a jittered pause, and its offset
    becomes committable once that second copy is acknowledged (no restart needed)."""
    from confluent_kafka import KafkaError

    now = [1000.0]
    fwd, consumer, producer = _forwarder(now)
    fwd.tracker.committed({(RETRY, 0): 3})
    fwd._handle(consumer, [Msg(3, 999_000)])  # type: ignore[arg-type, list-item]
    (first,) = producer.sent
    first["on_delivery"](KafkaError(KafkaError._MSG_TIMED_OUT), None)
    assert fwd.tracker.to_commit() == {}
    fwd._republish_due()
    assert len(producer.sent) == 1  # not at once: after the backoff
    assert 0.0 <= fwd._wait() <= 0.1
    now[0] += 10.0  # past the first pause (at most 0.1 s)
    fwd._republish_due()
    assert len(producer.sent) == 2
    assert producer.sent[1]["topic"] == "calmq.p.bulk"
    assert producer.sent[1]["value"] == b"avro bytes"
    producer.sent[1]["on_delivery"](None, None)
    assert fwd.tracker.to_commit() == {(RETRY, 0): 4}
    assert fwd.again == []


@pytest.mark.parametrize(("origin", "code"), [
    ("calmq.results", "missing_origin_topic"), ("calmq.dlq", "missing_origin_topic"),
    (RETRY, "missing_origin_topic"), ("elsewhere.p.bulk", "missing_origin_topic"),
    ("calmq.nopool.bulk", "unknown_topic"),
])
def test_a_retry_goes_back_only_to_an_existing_work_topic(origin: str, code: str) -> None:
    """Whoever can write to a retry topic sets its origin header: a retry is never sent on
    to the results or the dead letters, and one for a pool without topics is dead-lettered
    (it would otherwise be refused for ever and stall the partition)."""
    now = [1000.0]
    fwd, consumer, producer = _forwarder(now)
    fwd._handle(consumer, [Msg(3, 999_000, origin=origin)])  # type: ignore[arg-type, list-item]
    [record] = producer.sent
    assert record["topic"] == "calmq.dlq"
    assert dict(record["headers"])["calmq-error-code"] == code.encode()


def test_a_due_time_past_its_tier_is_held_no_longer_than_the_tier() -> None:
    """A due time centuries ahead holds a 5 s tier's partition for about 5 s, not for ever."""
    now = [1000.0]
    fwd, consumer, producer = _forwarder(now)
    fwd._handle(consumer, [Msg(4, 10**17)])  # type: ignore[arg-type, list-item]
    resume = fwd.resume_at[(RETRY, 0)]
    assert 1005.0 <= resume <= 1011.0
    assert producer.sent == []
    now[0] = resume  # the hold ran out: read again, the head goes back to its origin now
    fwd._resume_due(consumer)  # type: ignore[arg-type]
    fwd._handle(consumer, [Msg(4, 10**17)])  # type: ignore[arg-type, list-item]
    assert [r["topic"] for r in producer.sent] == ["calmq.p.bulk"]
class ConnectorMsg(Msg):
    """A retry message as the Debezium connector publishes it: the outbox ``headers``
    column as one ``calmq-headers`` JSON header, the value in JSON."""

    def __init__(self, offset: int, due_ms: int) -> None:
        super().__init__(offset, None, origin=None)
        packed = {ORIGIN: "calmq.p.bulk", DUE_AT: str(due_ms), "traceparent": "00-ab-cd-01"}
        self._headers += [("eventType", b"job.requested"),
                          ("calmq-headers", json.dumps(packed).encode())]

    def value(self) -> bytes:
        return b'{"job_id": "j"}'


def test_connector_message_is_forwarded_with_its_packed_headers_spread() -> None:
    """``calmq-headers`` is read as the relay's separate headers: the due time and origin
    drive the forwarder, and the republished copy carries ``traceparent`` on its own."""
    now = [1000.0]
    fwd, consumer, producer = _forwarder(now)
    fwd._handle(consumer, [ConnectorMsg(0, 1_005_000)])  # type: ignore[arg-type, list-item]
    assert producer.sent == []  # not due yet: the packed calmq-due-at was read
    now[0] = 1006.0
    fwd._resume_due(consumer)  # type: ignore[arg-type]
    fwd._handle(consumer, [ConnectorMsg(0, 1_005_000)])  # type: ignore[arg-type, list-item]
    (record,) = producer.sent
    assert record["topic"] == "calmq.p.bulk"
    assert record["value"] == b'{"job_id": "j"}'
    names = dict(record["headers"])
    assert names["traceparent"] == b"00-ab-cd-01"
    assert "calmq-headers" not in names
    assert ORIGIN not in names
    assert DUE_AT not in names
