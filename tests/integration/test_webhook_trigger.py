"""The job_events trigger queues a webhook delivery for each terminal event of a job with a
callback URL — and for nothing else (migration 0009 made it look jobs up by key)."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from calmq.tooling.devstack import StackState
from tests.support.workers import create_pool_topics, create_tenant_id, submit

pytestmark = pytest.mark.integration


def test_only_terminal_events_of_jobs_with_a_callback_queue_a_delivery(
        stack: StackState) -> None:
    url = stack.env["CALMQ_DATABASE_URL"]
    tenant, _key = create_tenant_id(url, f"hooks-{uuid.uuid4().hex[:8]}")
    pool = f"hooks{uuid.uuid4().hex[:6]}"  # its jobs' messages go to topics of their own
    create_pool_topics(stack.env["CALMQ_KAFKA_BOOTSTRAP"], pool, [])
    with_hook, without, also = submit(url, tenant, pool, [{"text": "a"}, {"text": "b"},
                                                             {"text": "c"}])
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE jobs SET callback_url = 'https://hooks.example/calmq' "
                     "WHERE id = ANY(%s::uuid[])", ([with_hook, also],))
        # One statement with a mix, as a group commit writes them.
        conn.execute(
            "INSERT INTO job_events (job_id, type, attempt, detail) VALUES "
            "(%(a)s, 'running', 1, '{}'), (%(a)s, 'completed', 1, '{}'), "
            "(%(b)s, 'completed', 1, '{}'), (%(c)s, 'running', 1, '{}')",
            {"a": with_hook, "b": without, "c": also})
        conn.execute("INSERT INTO job_events (job_id, type, attempt, detail) VALUES "
                     "(%s, 'dead_lettered', 2, '{}'), (%s, 'cancelled', 1, '{}')",
                     (with_hook, also))
        rows = conn.execute(
            "SELECT job_id::text, event_type, url, tenant_id FROM webhook_deliveries "
            "WHERE job_id = ANY(%s::uuid[]) ORDER BY event_type",
            ([with_hook, without, also],)).fetchall()
    assert [(r[0], r[1]) for r in rows] == [
        (also, "cancelled"), (with_hook, "completed"), (with_hook, "dead_lettered")]
    assert {r[2] for r in rows} == {"https://hooks.example/calmq"}
    assert {r[3] for r in rows} == {tenant}
