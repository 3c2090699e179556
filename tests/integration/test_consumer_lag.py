"""The lag sampler against a real broker: committed offsets and watermarks of owned partitions."""

from __future__ import annotations

import uuid

from confluent_kafka import Consumer, Producer, TopicPartition
from confluent_kafka.admin import AdminClient  # type: ignore[attr-defined]

from calmq.kafka import consumer_config, create_topics
from calmq.processors import metrics
from calmq.processors.lag import LagSampler, admin_config


def test_lag_is_what_the_group_has_not_committed_on_the_partitions_this_worker_owns(
        stack_env: dict[str, str]) -> None:
    bootstrap = stack_env["CALMQ_KAFKA_BOOTSTRAP"]
    topic = f"test.lag.{uuid.uuid4().hex[:8]}"
    create_topics(bootstrap, [topic], partitions=3)
    producer = Producer({"bootstrap.servers": bootstrap})
    for partition, count in ((0, 5), (1, 4), (2, 7)):
        for i in range(count):
            producer.produce(topic, value=f"m{i}".encode(), partition=partition)
    assert producer.flush(30) == 0
    config = consumer_config(bootstrap, f"test-lag-{uuid.uuid4().hex[:8]}")
    committer = Consumer(config)
    # Partition 0 done up to offset 2, partition 1 never committed, partition 2 not ours.
    committer.commit(offsets=[TopicPartition(topic, 0, 2)], asynchronous=False)
    committer.close()

    sampler = LagSampler(config, [topic], lambda: [(topic, 0), (topic, 1)])
    lag = sampler.sample(AdminClient(admin_config(config)))

    assert lag == {topic: (5 - 2) + 4}  # uncommitted partition 1 counts from its start
    assert metrics.CONSUMER_LAG.labels(topic)._value.get() == 7
    assert "group.id" not in admin_config(config)  # the group is the consumer's own setting
