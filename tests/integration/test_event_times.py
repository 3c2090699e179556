"""One job, one created_at: the job.requested SQL writes and what events._ms makes agree."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest

from calmq import events
from calmq.data import Store
from calmq.data.jobs import NewJob, insert_job_sync, insert_jobs
from calmq.tooling.devstack import StackState
from tests.support.workers import create_tenant_id

pytestmark = pytest.mark.integration


def _job(tenant_id: uuid.UUID) -> NewJob:
    # The stack's own pool: its topics exist, so the shared relay can publish these jobs (a
    # route without a topic stops the relay, which every later test would wait on).
    return NewJob(id=uuid.uuid4(), tenant_id=tenant_id, workflow="summarize", workflow_version=1,
                  priority="bulk", pool="default", step="summarize",
                  max_attempts=1, input={"text": "t"})


def test_job_requested_created_at_is_the_rows_time_truncated(stack: StackState) -> None:
    """For 60 jobs (single and group insert), the outbox created_at equals _ms(jobs.created_at)."""
    url = stack.env["CALMQ_DATABASE_URL"]
    tenant_id, _ = create_tenant_id(url, f"times-{uuid.uuid4().hex[:8]}")
    single = [_job(tenant_id) for _ in range(30)]
    grouped = [_job(tenant_id) for _ in range(30)]
    with psycopg.connect(url) as conn:
        for job in single:
            with conn.transaction():  # one transaction each: 30 distinct sub-ms times
                insert_job_sync(conn, job)

    async def group() -> None:
        store = Store(url, max_size=1)
        await store.open()
        try:
            for job in grouped:
                async with store.pool.connection() as conn:
                    await insert_jobs(conn, [job, _job(tenant_id)])
        finally:
            await store.close()

    asyncio.run(group())
    ids = [str(j.id) for j in single + grouped]
    with psycopg.connect(url) as conn:
        rows = conn.execute(
            "SELECT j.created_at, (o.payload->>'created_at')::bigint FROM jobs j"
            " JOIN outbox o ON o.aggregateid = j.id::text AND o.type = 'job.requested'"
            " WHERE j.id::text = ANY(%s)", (ids,)).fetchall()
    assert len(rows) == len(ids)
    assert [(events._ms(at), ms) for at, ms in rows] == [(ms, ms) for _, ms in rows]
