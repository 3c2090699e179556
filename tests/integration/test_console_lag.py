"""The console overview's consumer lag on the real stack: a topic with messages its group
has not consumed shows them as lag, and zero once a worker drained it."""

from __future__ import annotations

import re
import urllib.request
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, TopicPartition

from calmq import topics
from calmq.data import tenants
from calmq.kafka import consumer_config
from calmq.producers.console.session import COOKIE
from calmq.tooling.devstack import StackState
from tests.support.api import console_session
from tests.support.waiting import wait_for
from tests.support.workflow_env import WorkflowEnv
from tests.support.workflows import POOL

pytestmark = pytest.mark.integration

GROUP = f"calmq.{POOL}"  # the group the pool's workers consume in
WORK = [topics.topic_for_route(topics.work_route(POOL, p)) for p in ("interactive", "bulk")]


@pytest.fixture(scope="module")
def wf(stack: StackState) -> Iterator[WorkflowEnv]:
    env = WorkflowEnv(stack, workers=False)
    try:
        yield env
    finally:
        env.close()


def _lag(wf: WorkflowEnv, session: str) -> dict[str, int]:
    """The overview's lag table for the pool's group, as a platform key sees it."""
    req = urllib.request.Request(wf.api_url + "/console/overview",
                                 headers={"Cookie": f"{COOKIE}={session}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        html = resp.read().decode()
    rows = re.findall(r"<tr><td>([^<]+)</td><td>([^<]+)</td><td>(\d+)</td><td>([\d,]+)</td></tr>",
                      html)
    return {topic: int(lag.replace(",", "")) for group, topic, _n, lag in rows
            if group == GROUP}


def _commit_to_the_end(bootstrap: str) -> None:
    """The group as a worker that drained the pool's topics leaves it (no worker runs)."""
    consumer = Consumer(consumer_config(bootstrap, GROUP))
    try:
        metadata = consumer.list_topics(timeout=10)
        ends = []
        for topic in WORK:
            for partition in metadata.topics[topic].partitions:
                _low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition),
                                                            timeout=10)
                ends.append(TopicPartition(topic, partition, high))
        consumer.commit(offsets=ends, asynchronous=False)
    finally:
        consumer.close()


def test_the_overview_shows_lag_until_a_worker_drains_the_topic(wf: WorkflowEnv) -> None:
    platform = console_session(wf.api_url, tenants.add_key(wf.db, tenants.PLATFORM_TENANT,
                                                           None, platform=True))
    _commit_to_the_end(wf.stack.env["CALMQ_KAFKA_BOOTSTRAP"])
    ids = [wf.submit("invoice_t", {"text": "Vendor: Acme\nInvoice: 12\nTotal: EUR 3.00\n"})
           for _ in range(3)]
    # The relay publishes them; the group has not consumed them (no worker runs).
    lag = wait_for(lambda: (x := _lag(wf, platform)) and sum(x.values()) >= 3 and x,
                   timeout=60, what="the overview to show the unconsumed jobs as lag")
    assert set(lag) <= set(WORK), lag
    assert sum(lag.values()) == 3, lag

    wf.start_workers()
    for job_id in ids:
        assert wf.wait_status(job_id, "completed", "dead_letter")["status"] == "completed"
    wait_for(lambda: (x := _lag(wf, platform)) and sum(x.values()) == 0 and x, timeout=60,
             what="the overview to show zero lag once the worker drained the topic")
