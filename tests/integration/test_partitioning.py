"""calmq's producers choose the partition a Java producer (Kafka Connect, Debezium) would."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import KafkaError, Message, Producer

from calmq import topics
from calmq.kafka import produce, producer_config
from calmq.tooling.devstack import StackState
from tests.support.murmur2 import java_partition
from tests.support.relay import new_route

pytestmark = pytest.mark.integration


def test_job_id_keys_land_where_javas_murmur2_puts_them(stack: StackState) -> None:
    """For 200 job ids, the broker-acknowledged partition is toPositive(murmur2(key)) % 12."""
    bootstrap = stack.env["CALMQ_KAFKA_BOOTSTRAP"]
    partitions = 12
    topic = topics.topic_for_route(new_route(bootstrap, partitions=partitions))
    producer = Producer(producer_config(bootstrap))
    acked: dict[bytes, int] = {}
    failed: list[KafkaError] = []

    def on_delivery(err: KafkaError | None, msg: Message) -> None:
        if err is not None:
            failed.append(err)
            return
        key = msg.key()
        partition = msg.partition()
        assert isinstance(key, bytes)
        assert partition is not None
        acked[key] = partition

    keys = [str(uuid.uuid4()).encode() for _ in range(200)]
    for key in keys:
        produce(producer, topic, key, b"{}", headers=[], on_delivery=on_delivery)
    assert producer.flush(30) == 0
    assert not failed
    assert {k: java_partition(k, partitions) for k in keys} == acked
    # CRC32 (librdkafka's default) would agree on about one key in twelve: the sample tells.
    assert len(set(acked.values())) == partitions
