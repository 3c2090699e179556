"""Two environments on one Kafka broker and one schema registry: the session's stack (no name
prefix) and a second set of calmq services with CALMQ_NAME_PREFIX and a database of their
own, running side by side. Each completes its own jobs on its own topics and groups."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from confluent_kafka import Consumer, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.schema_registry import SchemaRegistryClient

from calmq.tooling.devstack import StackState
from tests.support.api import Api, create_tenant
from tests.support.cli import calmq, calmq_env
from tests.support.waiting import wait_for
from tests.support.workers import TERMINAL, Procs

pytestmark = pytest.mark.integration


@dataclass
class Staging:
    prefix: str
    api: Api
    tenant: str
    env: dict[str, str]


@pytest.fixture
def staging(stack: StackState, fresh_db: str, tmp_path: Path) -> Iterator[Staging]:
    """A second environment on the stack's broker and registry: its name prefix (unique to
    the run, as topics outlive it), its settings, and a tenant of its own API, its relay
    (polling, so it needs no replication slot on the shared server) and its worker running."""
    prefix = f"stg{uuid.uuid4().hex[:6]}."
    settings = {"CALMQ_DATABASE_URL": fresh_db, "CALMQ_NAME_PREFIX": prefix,
                "CALMQ_RELAY_MODE": "polling"}
    env = calmq_env(stack, **settings)
    env.pop("CALMQ_API_URL", None)
    for argv in (("migrate",), ("topics", "create"), ("schemas", "register")):
        done = calmq(stack, *argv, "--data-dir", str(tmp_path), env=env)
        assert done.returncode == 0, done.stdout + done.stderr
    procs = Procs({**stack.env, **settings}, tmp_path / "logs")
    try:
        url = procs.api()
        procs.start("relay", "relay")
        procs.worker("default")
        tenant = f"stg-{uuid.uuid4().hex[:8]}"
        yield Staging(prefix, Api(url, create_tenant(fresh_db, tenant)), tenant, env)
    finally:
        procs.stop_all()


def _finished(api: Api, job_id: str) -> dict[str, object]:
    return wait_for(lambda: (j := api.job(job_id))["status"] in TERMINAL and j, timeout=60,
                    what=f"job {job_id} to finish")


def test_a_prefixed_and_an_unprefixed_environment_complete_their_jobs_on_one_broker(
        stack: StackState, staging: Staging) -> None:
    """Jobs of the prefixed environment and of the plain one both complete, each through
    its own topics, consumer groups and schema subjects on the same broker and registry."""
    prefix, staged = staging.prefix, staging.api
    plain = Api(stack.env["CALMQ_API_URL"],
                create_tenant(stack.env["CALMQ_DATABASE_URL"], f"prod-{uuid.uuid4().hex[:8]}"))
    staged_ids = [staged.submit({"text": f"staging {n}", "mode": "success"}) for n in range(3)]
    plain_ids = [plain.submit({"text": f"production {n}", "mode": "success"}) for n in range(3)]
    for api, ids in ((staged, staged_ids), (plain, plain_ids)):
        assert [_finished(api, i)["status"] for i in ids] == ["completed"] * 3
    # Each environment's jobs are its own: the other's API does not know them.
    status, _headers, _body = plain.call("GET", f"/v1/jobs/{staged_ids[0]}")
    assert status == 404

    admin = AdminClient({"bootstrap.servers": stack.env["CALMQ_KAFKA_BOOTSTRAP"]})
    names = set(admin.list_topics(timeout=10).topics)
    for route in ("default.interactive", "default.bulk", "results", "dlq"):
        assert {f"calmq.{route}", f"{prefix}calmq.{route}"} <= names
    groups = {g.group_id for g in admin.list_consumer_groups().result(timeout=10).valid}
    assert {"calmq.default", f"{prefix}calmq.default"} <= groups
    # The results went out on the environment's own results topic.
    assert _records(stack, f"{prefix}calmq.results") >= 3
    registry = SchemaRegistryClient({"url": stack.env["CALMQ_SCHEMA_REGISTRY_URL"]})
    subjects = set(registry.get_subjects())
    staged_subjects = {s.removeprefix(prefix) for s in subjects if s.startswith(prefix)}
    assert staged_subjects
    assert staged_subjects <= subjects  # the plain environment's, under their own names


def _records(stack: StackState, topic: str) -> int:
    """How many records ``topic`` holds (its partitions' high watermarks, summed)."""
    consumer = Consumer({"bootstrap.servers": stack.env["CALMQ_KAFKA_BOOTSTRAP"],
                         "group.id": f"test-{uuid.uuid4().hex[:8]}"})
    try:
        partitions = consumer.list_topics(topic, timeout=10).topics[topic].partitions
        return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
                   for p in partitions)
    finally:
        consumer.close()


def test_a_tenants_own_results_topic_in_a_prefixed_environment(
        stack: StackState, staging: Staging) -> None:
    """`calmq tenants results-topic` in a prefixed environment makes the prefixed topic, and
    the tenant's results are published there (the database keeps the name without it)."""
    done = calmq(stack, "tenants", "results-topic", staging.tenant, env=staging.env)
    assert done.returncode == 0, done.stdout + done.stderr
    topic = f"{staging.prefix}calmq.results.{staging.tenant}"
    assert done.stdout.strip() == topic
    ids = [staging.api.submit({"text": f"own topic {n}", "mode": "success"}) for n in range(2)]
    assert [_finished(staging.api, i)["status"] for i in ids] == ["completed"] * 2
    wait_for(lambda: _records(stack, topic) >= 2, timeout=30,
             what=f"the tenant's results on {topic}")
