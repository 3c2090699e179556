"""Results per tenant (migration 0056): a tenant with a results topic of its own has its
job.result events there and its dead letters on the .dlq twin, and nowhere else; a tenant
without one stays on the shared calmq.results. Real Kafka, PostgreSQL, relay and workers."""

from __future__ import annotations

import uuid
from typing import Any

import pytest
from confluent_kafka import Consumer, TopicPartition

from calmq import topics
from calmq.codec import decode_message, make_codec
from calmq.tooling.devstack import StackState
from tests.support.api import Api, create_tenant
from tests.support.cli import calmq, calmq_env
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration

TERMINAL = ("completed", "dead_letter", "cancelled")


class Topic:
    """Every event on ``name`` from its start, decoded, as (event type, event)."""

    def __init__(self, stack: StackState, name: str) -> None:
        self.name = name
        self.codec = make_codec(stack.env["CALMQ_SCHEMA_REGISTRY_URL"])
        self.consumer = Consumer({
            "bootstrap.servers": stack.env["CALMQ_KAFKA_BOOTSTRAP"],
            "group.id": f"per-tenant-{uuid.uuid4().hex}", "enable.auto.commit": False})
        meta = self.consumer.list_topics(name, timeout=10).topics[name]
        self.partitions = [TopicPartition(name, p, 0) for p in meta.partitions]
        self.consumer.assign(self.partitions)
        self.events: list[tuple[str, dict[str, Any]]] = []

    def read(self) -> list[tuple[str, dict[str, Any]]]:
        """What arrived since the last read, appended to ``events``."""
        for msg in self.consumer.consume(num_messages=1000, timeout=0.5):
            if msg.error() is None and msg.value() is not None:
                headers = dict(msg.headers() or [])
                kind = headers.get("eventType")
                self.events.append(decode_message(
                    self.codec, bytes(msg.value() or b""),
                    kind.decode() if isinstance(kind, bytes) else None))
        return self.events

    def read_to_end(self) -> list[tuple[str, dict[str, Any]]]:
        """Everything up to the topic's end as it is now."""
        ends = {p.partition: self.consumer.get_watermark_offsets(p, timeout=10)[1]
                for p in self.partitions}

        def at_end() -> bool:
            self.read()
            positions = self.consumer.position(self.partitions)
            return all(p.offset >= ends[p.partition] or ends[p.partition] == 0
                       for p in positions)

        wait_for(at_end, timeout=60, what=f"the end of {self.name}")
        return self.events

    def jobs(self) -> set[str]:
        return {str(event["job_id"]) for _kind, event in self.events}

    def close(self) -> None:
        self.consumer.close()


def _tenant(stack: StackState, name: str, **env: str) -> str:
    done = calmq(stack, "tenants", "create", name, env=calmq_env(stack, **env))
    assert done.returncode == 0, done.stderr
    return done.stdout.strip().splitlines()[-1]


def test_a_tenants_consumer_on_its_own_topic_sees_none_of_another_tenants_events(
        stack: StackState) -> None:
    """With CALMQ_RESULTS_TOPIC_PER_TENANT, tenant A's results and dead letters are on
    calmq.results.A (and .dlq) only; B, configured to a topic it names, has its own; C,
    configured with neither, stays on the shared calmq.results."""
    tag = uuid.uuid4().hex[:8]
    a_name, b_name = f"pertenant-a-{tag}", f"pertenant-b-{tag}"
    a_key = _tenant(stack, a_name, CALMQ_RESULTS_TOPIC_PER_TENANT="true")
    b_key = create_tenant(stack.env["CALMQ_DATABASE_URL"], b_name)
    b_topic = f"calmq.results.custom-{tag}"
    configured = calmq(stack, "tenants", "results-topic", b_name, "--topic", b_topic)
    assert configured.returncode == 0, configured.stderr
    assert configured.stdout.strip() == b_topic
    c_key = create_tenant(stack.env["CALMQ_DATABASE_URL"], f"pertenant-c-{tag}")

    a_topic = f"calmq.results.{a_name}"
    readers = {name: Topic(stack, name) for name in
               (a_topic, topics.dead_letter_topic(a_topic), b_topic, topics.RESULTS)}
    try:
        a, b, c = (Api(stack.env["CALMQ_API_URL"], k) for k in (a_key, b_key, c_key))
        a_jobs = [a.submit({"text": "A's", "mode": "success"}) for _ in range(3)]
        a_dead = a.submit({"text": "A's malformed", "mode": "malformed"})
        b_jobs = [b.submit({"text": "B's", "mode": "success"}) for _ in range(3)]
        b_jobs.append(b.submit({"text": "B's malformed", "mode": "malformed"}))
        c_job = c.submit({"text": "C's", "mode": "success"})
        for api, job_id in ([(a, j) for j in [*a_jobs, a_dead]] + [(b, j) for j in b_jobs]
                            + [(c, c_job)]):
            wait_for(lambda api=api, job_id=job_id: api.job(job_id)["status"] in TERMINAL,
                     timeout=90, what=f"job {job_id} to finish")
        assert a.job(a_dead)["status"] == "dead_letter"

        # Each tenant's events arrive where they belong...
        a_all, b_all = {*a_jobs, a_dead}, set(b_jobs)
        wait_for(lambda: readers[a_topic].read() and readers[a_topic].jobs() >= a_all,
                 timeout=60, what=f"A's results on {a_topic}")
        wait_for(lambda: readers[b_topic].read() and readers[b_topic].jobs() >= b_all,
                 timeout=60, what=f"B's results on {b_topic}")
        dlq = readers[topics.dead_letter_topic(a_topic)]
        wait_for(lambda: dlq.read() and a_dead in dlq.jobs(), timeout=60,
                 what="A's dead letter on its .dlq topic")
        shared = readers[topics.RESULTS]
        wait_for(lambda: shared.read() and c_job in shared.jobs(), timeout=60,
                 what="C's result on the shared calmq.results")

        # ...and nowhere else: A's topics hold A's jobs alone, B's B's, the shared neither.
        on_a = readers[a_topic].read_to_end()
        assert readers[a_topic].jobs() == a_all
        assert {kind for kind, _e in on_a} == {"job.result"}
        assert {str(e["tenant_id"]) for _k, e in on_a} == {str(on_a[0][1]["tenant_id"])}
        dlq.read_to_end()
        assert dlq.jobs() == {a_dead}
        assert {kind for kind, _e in dlq.events} == {"job.dead_lettered"}
        readers[b_topic].read_to_end()
        assert readers[b_topic].jobs() == b_all
        shared.read_to_end()
        assert not shared.jobs() & (a_all | b_all)
    finally:
        for reader in readers.values():
            reader.close()


def test_a_results_topic_outside_calmq_results_is_refused(stack: StackState) -> None:
    """`calmq tenants results-topic NAME --topic T` refuses a topic that could be one of
    calmq's own (a work topic) and leaves the tenant on the shared topic."""
    name = f"pertenant-bad-{uuid.uuid4().hex[:8]}"
    create_tenant(stack.env["CALMQ_DATABASE_URL"], name)
    for bad in ("calmq.default.interactive", "calmq.results.bulk", "calmq.results"):
        done = calmq(stack, "tenants", "results-topic", name, "--topic", bad)
        assert done.returncode != 0
        assert "cannot be a tenant's results topic" in done.stderr


def test_topics_create_gives_every_tenant_without_one_its_own(stack: StackState) -> None:
    """`calmq topics create` with CALMQ_RESULTS_TOPIC_PER_TENANT creates calmq.results.<name>
    and its .dlq for a tenant that had none, then routes the tenant's results there."""
    name = f"pertenant-late-{uuid.uuid4().hex[:8]}"
    key = create_tenant(stack.env["CALMQ_DATABASE_URL"], name)
    done = calmq(stack, "topics", "create", "-o", "jsonl",
                 env=calmq_env(stack, CALMQ_RESULTS_TOPIC_PER_TENANT="true"))
    assert done.returncode == 0, done.stderr
    own = f"calmq.results.{name}"
    assert own in done.stdout
    assert topics.dead_letter_topic(own) in done.stdout
    reader = Topic(stack, own)  # the topic exists: its metadata has partitions
    try:
        api = Api(stack.env["CALMQ_API_URL"], key)
        job_id = api.submit({"text": "late", "mode": "success"})
        wait_for(lambda: reader.read() and job_id in reader.jobs(), timeout=90,
                 what=f"the result on {own}")
    finally:
        reader.close()
