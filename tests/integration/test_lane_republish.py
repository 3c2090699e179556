"""Re-publishes keep a job's lane (issue 27): a batch-lane job redriven from the dead letters,
or approved in review and moved on to its next step, is requested again on its pool's batch
topic, never on the online one (where it would run at the online price). The hold-release
paths are tested in test_spend_caps, test_tenant_quota and test_review_caps."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable

import psycopg
import pytest
from psycopg.types.json import Jsonb

from calmq.data import Store
from calmq.data.jobs import insert_job
from calmq.deadletters import DeadLetters
from calmq.objects import open_object_store
from calmq.producers.intake import prepare
from calmq.reviews import Decision, ReviewDesk
from calmq.tooling.devstack import StackState
from calmq.workflows import builtin_workflows
from tests.support.workers import create_tenant_id

pytestmark = pytest.mark.integration

POOL_WORKFLOWS = builtin_workflows()


def _run(stack: StackState, act: Callable[[Store], Awaitable[None]]) -> None:
    async def main() -> None:
        store = Store(stack.env["CALMQ_DATABASE_URL"], max_size=2)
        await store.open()
        try:
            await act(store)
        finally:
            await store.close()
    asyncio.run(main())


def _batch_job(stack: StackState, workflow: str, data: dict[str, str]) -> uuid.UUID:
    tenant_id, _key = create_tenant_id(stack.env["CALMQ_DATABASE_URL"],
                                       f"lane-{uuid.uuid4().hex[:8]}")
    wf = POOL_WORKFLOWS[workflow]
    job = prepare(wf, tenant_id, input=wf.validate_input(data), lane="batch")

    async def insert(store: Store) -> None:
        async with store.pool.connection() as conn, conn.transaction():
            await insert_job(conn, job)

    _run(stack, insert)
    return job.id


def _last_requested_route(stack: StackState, job_id: uuid.UUID) -> str:
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        row = conn.execute("SELECT aggregatetype FROM outbox WHERE aggregateid = %s AND"
                           " type = 'job.requested' ORDER BY seq DESC LIMIT 1",
                           (str(job_id),)).fetchone()
    assert row is not None
    return str(row[0])


def test_a_redriven_batch_lane_job_is_requested_on_the_batch_topic(stack: StackState) -> None:
    """A dead-lettered batch-lane job that is redriven goes back to <pool>.batch."""
    job_id = _batch_job(stack, "summarize", {"text": "redrive me"})
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        conn.execute("UPDATE jobs SET status = 'dead_letter', attempt = 1,"
                     " error = '{\"code\": \"x\", \"class\": \"transient\", \"message\": \"m\"}'"
                     " WHERE id = %s", (job_id,))

    async def redrive(store: Store) -> None:
        [outcome] = await DeadLetters(store, workflows=POOL_WORKFLOWS).redrive(
            [job_id], by="test", reason="the provider is back")
        assert outcome.outcome == "redriven", outcome

    _run(stack, redrive)
    assert _last_requested_route(stack, job_id) == "default.batch"


def test_an_approved_batch_lane_job_moves_on_on_the_batch_topic(stack: StackState) -> None:
    """A batch-lane invoice approved at its review step is requested for its next step on
    <pool>.batch."""
    job_id = _batch_job(stack, "invoice", {"text": "Vendor: ACME\nTotal: EUR 1.00"})
    fields = {"vendor": "ACME", "invoice_number": "1", "total": 1.0, "currency": "EUR",
              "confidence": 0.5}
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        conn.execute("UPDATE jobs SET status = 'awaiting_review', step = 'extract_fields',"
                     " attempt = 1 WHERE id = %s", (job_id,))
        conn.execute("INSERT INTO step_outputs (job_id, step, state, output, confidence)"
                     " VALUES (%s, 'extract_fields', 'pending_review', %s, 0.5)",
                     (job_id, Jsonb(fields)))
        tenant = conn.execute("SELECT tenant_id FROM jobs WHERE id = %s", (job_id,)).fetchone()
    assert tenant is not None

    async def approve(store: Store) -> None:
        desk = ReviewDesk(store, POOL_WORKFLOWS,
                          open_object_store(stack.env["CALMQ_OBJECT_STORE_URL"]))
        status = await desk.decide(tenant[0], job_id, Decision("approve", "test reviewer"))
        assert status == "queued"

    _run(stack, approve)
    assert _last_requested_route(stack, job_id) == "default.batch"
