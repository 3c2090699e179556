"""Kafka wiring: client configurations, topic creation, headers. Topic names: calmq.topics."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from calmq.errors import InfrastructureError

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_COMPRESSION",
    "consumer_config",
    "create_topics",
    "header",
    "headers_dict",
    "produce",
    "producer_config",
]


# Batch codecs librdkafka writes. The default is one every mainstream client decodes without
# a plugin: kafkajs, for one, reads gzip natively but throws on lz4, snappy and zstd batches
# until a codec package is registered, and calmq.results is read by other teams' clients.
COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")
# none rather than gzip: measured on the relay (docs/reference/topics.md), gzip cost a quarter
# of the drain rate and ten times the commit-to-ack latency; calmq's Avro events are small.
DEFAULT_COMPRESSION = "none"


def producer_config(
    bootstrap: str, *, compression: str = DEFAULT_COMPRESSION, **extra: Any
) -> dict[str, Any]:
    """An idempotent producer: retries never duplicate or reorder within a partition.

    ``murmur2_random`` is the Java client's partitioner (and so Kafka Connect's, Debezium's
    and Kafka Streams'): murmur2 of the key, positive, modulo the partition count. librdkafka's
    default (``consistent_random``, CRC32) sends most keys elsewhere, so one job's events
    published by calmq and by a Java producer (the Debezium connector standing in for the
    relay, an upstream service) would land in different partitions and lose per-job order.
    Records without a key go to a random partition, as with the Java client.
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression {compression!r} is not one of {', '.join(COMPRESSIONS)}")
    return {
        "bootstrap.servers": bootstrap,
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 2,
        "partitioner": "murmur2_random",
        "compression.type": compression,
        "batch.num.messages": 10000,
        "queue.buffering.max.messages": 500000,
        **extra,
    }


def consumer_config(bootstrap: str, group: str, **extra: Any) -> dict[str, Any]:
    """Manual commits only: an offset is committed after its job's outcome is durable."""
    return {
        "bootstrap.servers": bootstrap,
        "group.id": group,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "partition.assignment.strategy": "cooperative-sticky",
        "session.timeout.ms": 10000,
        "heartbeat.interval.ms": 1000,
        "max.poll.interval.ms": 300000,
        "fetch.wait.max.ms": 10,
        **extra,
    }


def create_topics(
    bootstrap: str, names: Iterable[str], *, partitions: int, replication: int = 1,
    max_message_bytes: int | None = None,
) -> list[str]:
    """Create the topics that do not exist yet; returns the ones created now.

    ``max_message_bytes``: the topics' ``max.message.bytes``, the same number as the relay
    producer's ``message.max.bytes`` (setting kafka_max_message_bytes), so a record the
    relay may send is one every topic takes (None: the broker's default)."""
    admin = AdminClient({"bootstrap.servers": bootstrap})
    try:
        existing = set(admin.list_topics(timeout=15).topics)
    except KafkaException as exc:
        raise InfrastructureError(f"cannot reach Kafka at {bootstrap}: {exc}") from exc
    wanted = [n for n in dict.fromkeys(names) if n not in existing]
    if not wanted:
        return []
    config = ({} if max_message_bytes is None
              else {"max.message.bytes": str(max_message_bytes)})
    futures = admin.create_topics(
        [NewTopic(n, num_partitions=partitions, replication_factor=replication,
                  config=config) for n in wanted],
        operation_timeout=30,
    )
    created = []
    for name, future in futures.items():
        try:
            future.result()
            created.append(name)
        except KafkaException as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise InfrastructureError(f"cannot create topic {name}: {exc}") from exc
    return created


def produce(
    producer: Producer,
    topic: str,
    key: bytes | None,
    value: bytes | None,
    *,
    headers: list[tuple[str, str | bytes | None]],
    on_delivery: Callable[[KafkaError | None, Message], None],
) -> None:
    """Produce one record; when the local queue is full, serve delivery reports and retry.

    Blocking here is the back pressure the relay and the forwarder want: neither may drop a
    record, and both confirm their source only after its delivery report.
    """
    while True:
        try:
            producer.produce(topic, value=value, key=key, headers=headers,
                             on_delivery=on_delivery)
            return
        except BufferError:
            producer.poll(0.05)


def header(headers: Sequence[tuple[str, bytes | None]] | None, name: str) -> str | None:
    for key, value in headers or ():
        if key == name and value is not None:
            return value.decode("utf-8", "replace")
    return None


def headers_dict(headers: Sequence[tuple[str, bytes | None]] | None) -> dict[str, str]:
    return {k: v.decode("utf-8", "replace") for k, v in headers or () if v is not None}
