"""The kernel's lag reader (calmq.lag) against a real broker: committed offsets of a group it
never joins, and watermarks, per partition; the fleet's groups derived from topic names."""

from __future__ import annotations

import uuid

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from calmq import topics
from calmq.kafka import consumer_config, create_topics
from calmq.lag import LagReader, per_group_topic

pytestmark = pytest.mark.integration


def _topic_with(bootstrap: str, name: str, counts: tuple[int, ...]) -> None:
    create_topics(bootstrap, [name], partitions=len(counts))
    producer = Producer({"bootstrap.servers": bootstrap})
    for partition, count in enumerate(counts):
        for i in range(count):
            producer.produce(name, value=f"m{i}".encode(), partition=partition)
    assert producer.flush(30) == 0


def _commit(bootstrap: str, group: str, offsets: list[TopicPartition]) -> None:
    committer = Consumer(consumer_config(bootstrap, group))
    committer.commit(offsets=offsets, asynchronous=False)
    committer.close()


def test_lag_is_what_the_group_has_not_committed_on_the_partitions_asked_for(
        stack_env: dict[str, str]) -> None:
    """Per partition: end minus committed offset; a partition never committed counts from
    its start; a partition not asked for is not read."""
    bootstrap = stack_env["CALMQ_KAFKA_BOOTSTRAP"]
    topic = f"test.lag.{uuid.uuid4().hex[:8]}"
    _topic_with(bootstrap, topic, (5, 4, 7))
    group = f"test-lag-{uuid.uuid4().hex[:8]}"
    # Partition 0 done up to offset 2, partition 1 never committed, partition 2 not asked.
    _commit(bootstrap, group, [TopicPartition(topic, 0, 2)])

    reader = LagReader(consumer_config(bootstrap, group))
    try:
        rows = reader.read(group, [(topic, 0), (topic, 1)])
    finally:
        reader.close()
    assert [(r.partition, r.committed_offset, r.end_offset, r.lag) for r in rows] == [
        (0, 2, 5, 3), (1, None, 4, 4)]
    assert sum(r.lag for r in rows) == (5 - 2) + 4


def test_the_fleet_is_every_calmq_group_on_the_topics_it_committed_on(
        stack_env: dict[str, str]) -> None:
    """read_fleet finds a pool's worker group by its work topics' names and sums its lag per
    topic; a topic the group never committed on is left out."""
    bootstrap = stack_env["CALMQ_KAFKA_BOOTSTRAP"]
    pool = f"lagfleet{uuid.uuid4().hex[:8]}"
    bulk = topics.topic_for_route(topics.work_route(pool, "bulk"))
    interactive = topics.topic_for_route(topics.work_route(pool, "interactive"))
    _topic_with(bootstrap, bulk, (3, 2))
    _topic_with(bootstrap, interactive, (1,))
    _commit(bootstrap, topics.worker_group(pool), [TopicPartition(bulk, 0, 1)])

    reader = LagReader({"bootstrap.servers": bootstrap})
    try:
        mine = [g for g in per_group_topic(reader.read_fleet())
                if g.group == topics.worker_group(pool)]
    finally:
        reader.close()
    assert [(g.topic, g.partitions, g.lag) for g in mine] == [(bulk, 2, (3 - 1) + 2)]
