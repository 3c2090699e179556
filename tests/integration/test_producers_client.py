"""The client library: enqueue inside the caller's transaction, and group commit of submits."""

from __future__ import annotations

import asyncio
import uuid

import psycopg
import pytest
from psycopg_pool import AsyncConnectionPool

from calmq.errors import ContractError, InfrastructureError
from calmq.producers.client import enqueue, enqueue_async
from calmq.producers.intake import GroupCommit, prepare
from calmq.tooling.devstack import StackState
from calmq.workflows import builtin_workflows
from tests.support.api import Api, create_tenant
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tenant(stack: StackState) -> tuple[uuid.UUID, str]:
    name = f"client-{uuid.uuid4().hex[:8]}"
    key = create_tenant(stack.env["CALMQ_DATABASE_URL"], name)
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        row = conn.execute("SELECT id FROM tenants WHERE name = %s", (name,)).fetchone()
    assert row is not None
    return row[0], key


def _rows(url: str, job_id: uuid.UUID) -> tuple[int, int, int]:
    """(job rows, 'queued' events, job.requested outbox rows): what enqueue writes. A worker
    of the shared stack may claim (and finish) the job as soon as it commits, so later
    history and events (its job.result) are not counted."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT (SELECT count(*) FROM jobs WHERE id = %(id)s),"
            " (SELECT count(*) FROM job_events WHERE job_id = %(id)s AND type = 'queued'),"
            " (SELECT count(*) FROM outbox WHERE aggregateid = %(id)s::text"
            "  AND type = 'job.requested')",
            {"id": job_id}).fetchone()
    assert row is not None
    return row


def test_enqueue_rolls_back_with_the_callers_transaction(
        stack: StackState, tenant: tuple[uuid.UUID, str]) -> None:
    """A job enqueued in a transaction that rolls back leaves no job, event or outbox row."""
    url = stack.env["CALMQ_DATABASE_URL"]
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TEMP TABLE orders (id int)")
        conn.execute("INSERT INTO orders VALUES (1)")
        job_id = enqueue(conn, tenant_id=tenant[0], workflow="summarize",
                         input={"text": "never"})
        assert _rows(url, job_id) == (0, 0, 0)  # not visible before the caller commits
        conn.rollback()
    assert _rows(url, job_id) == (0, 0, 0)


def test_enqueue_commits_with_the_business_write_and_the_job_completes(
        stack: StackState, tenant: tuple[uuid.UUID, str]) -> None:
    """A job enqueued next to a business write commits with it and runs through the pipeline."""
    url = stack.env["CALMQ_DATABASE_URL"]
    with psycopg.connect(url) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS client_test_orders (id uuid PRIMARY KEY)")
        order = uuid.uuid4()
        conn.execute("INSERT INTO client_test_orders VALUES (%s)", (order,))
        job_id = enqueue(conn, tenant_id=tenant[0], workflow="summarize",
                         input={"text": "from an upstream service", "mode": "success"},
                         metadata={"order": str(order)})
    assert _rows(url, job_id) == (1, 1, 1)

    api = Api(stack.env["CALMQ_API_URL"], tenant[1])
    job = wait_for(lambda: (j := api.job(str(job_id)))["status"] in ("completed", "dead_letter")
                   and j, timeout=60, what="the enqueued job to finish")
    assert job["status"] == "completed"


def test_enqueue_takes_a_workflow_registered_by_module(
        stack: StackState, tenant: tuple[uuid.UUID, str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """enqueue knows a workflow the API registers from CALMQ_WORKFLOW_MODULES, not only the
    built-ins, and validates its input the same way."""
    monkeypatch.setenv("CALMQ_WORKFLOW_MODULES", "tests.support.workflows")
    url = stack.env["CALMQ_DATABASE_URL"]
    with psycopg.connect(url) as conn:
        with pytest.raises(ContractError) as bad:
            enqueue(conn, tenant_id=tenant[0], workflow="summarize_t", input={"text": 5})
        assert bad.value.code == "invalid_input"
        job_id = enqueue(conn, tenant_id=tenant[0], workflow="summarize_t",
                         input={"text": "a registered workflow"})
    assert _rows(url, job_id) == (1, 1, 1)
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT workflow FROM jobs WHERE id = %s", (job_id,)).fetchone()
    assert row == ("summarize_t",)


async def test_enqueue_async_validates_before_writing(
        stack: StackState, tenant: tuple[uuid.UUID, str]) -> None:
    """enqueue_async refuses bad input with the API's codes and writes on the caller's commit."""
    url = stack.env["CALMQ_DATABASE_URL"]
    async with await psycopg.AsyncConnection.connect(url) as conn:
        with pytest.raises(ContractError) as bad:
            await enqueue_async(conn, tenant_id=tenant[0], workflow="summarize",
                                input={"text": 5})
        assert bad.value.code == "invalid_input"
        with pytest.raises(ContractError) as unknown:
            await enqueue_async(conn, tenant_id=tenant[0], workflow="nope", input={})
        assert unknown.value.code == "unknown_workflow"
        job_id = await enqueue_async(conn, tenant_id=tenant[0], workflow="summarize",
                                     input={"text": "async"}, priority="interactive")
        await conn.commit()
    assert _rows(url, job_id) == (1, 1, 1)


async def test_group_commit_shares_transactions_and_isolates_a_bad_row(
        stack: StackState, tenant: tuple[uuid.UUID, str]) -> None:
    """300 concurrent submits share transactions; a row that cannot be written fails alone."""
    url = stack.env["CALMQ_DATABASE_URL"]
    workflow = builtin_workflows()["summarize"]
    pool = AsyncConnectionPool(url, min_size=2, max_size=2, open=False,
                               kwargs={"autocommit": True})
    await pool.open()
    try:
        group = GroupCommit(pool, max_batch=64)
        jobs = [prepare(workflow, tenant[0], input={"text": f"g{i}"}) for i in range(300)]
        bad = prepare(workflow, uuid.uuid4(), input={"text": "no such tenant"})
        results = await asyncio.gather(
            *(group.submit(j) for j in [*jobs[:150], bad, *jobs[150:]]),
            return_exceptions=True)
    finally:
        await pool.close()
    assert isinstance(results[150], InfrastructureError)
    assert [r for i, r in enumerate(results) if i != 150] == [None] * 300
    assert group.batches < 300
    with psycopg.connect(url) as conn:
        ids = [j.id for j in jobs]
        row = conn.execute("SELECT count(*) FROM jobs WHERE id = ANY(%s)", (ids,)).fetchone()
        assert row == (300,)
        assert conn.execute("SELECT count(*) FROM jobs WHERE id = %s",
                            (bad.id,)).fetchone() == (0,)


async def test_group_commit_answers_every_request_when_a_row_has_unstorable_text(
        stack: StackState, tenant: tuple[uuid.UUID, str]) -> None:
    """Rows whose text cannot be stored get unstorable_text; every neighbour is committed."""
    url = stack.env["CALMQ_DATABASE_URL"]
    workflow = builtin_workflows()["summarize"]
    pool = AsyncConnectionPool(url, min_size=1, max_size=1, open=False,
                               kwargs={"autocommit": True})
    await pool.open()
    try:
        # One writer: the whole batch is one group, so the bad rows share it with the good.
        group = GroupCommit(pool, max_batch=64, writers=1)
        good = [prepare(workflow, tenant[0], input={"text": f"n{i}"}) for i in range(12)]
        bad = [
            # A traceparent byte 0xFF reaches us as a lone surrogate: the driver's UTF-8
            # encoding raises UnicodeEncodeError, not a psycopg.Error.
            prepare(workflow, tenant[0], input={"text": "x"},
                    trace_parent="00-\udcff-01"),
            prepare(workflow, tenant[0], input={"text": "lone \ud800 surrogate"}),
            prepare(workflow, tenant[0], input={"text": "x"}, metadata={"k": "nul\x00"}),
        ]
        batch = [*good[:4], bad[0], *good[4:8], bad[1], *good[8:], bad[2]]
        async with asyncio.timeout(30):
            results = await asyncio.gather(*(group.submit(j) for j in batch),
                                           return_exceptions=True)
    finally:
        await pool.close()
    answers = dict(zip([j.id for j in batch], results, strict=True))
    for job in bad:
        error = answers[job.id]
        assert isinstance(error, ContractError), error
        assert (error.code, error.status) == ("unstorable_text", 400)
    assert [answers[j.id] for j in good] == [None] * len(good)
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM jobs WHERE id = ANY(%s)",
                           ([j.id for j in good],)).fetchone()
        assert row == (len(good),)
        row = conn.execute("SELECT count(*) FROM jobs WHERE id = ANY(%s)",
                           ([j.id for j in bad],)).fetchone()
        assert row == (0,)


def test_enqueue_refuses_metadata_too_large_for_the_events(
        stack: StackState, tenant: tuple[uuid.UUID, str]) -> None:
    """enqueue holds metadata to the API's limit as the events carry it: 600 kB of UTF-8
    raises metadata_too_large and writes nothing."""
    url = stack.env["CALMQ_DATABASE_URL"]
    with psycopg.connect(url) as conn:
        with pytest.raises(ContractError) as caught:
            enqueue(conn, tenant_id=tenant[0], workflow="summarize", input={"text": "x"},
                    metadata={"note": "é" * 300_000})
        assert caught.value.code == "metadata_too_large"
        assert caught.value.status == 413
        count = conn.execute("SELECT count(*) FROM jobs WHERE tenant_id = %s AND"
                             " metadata ? 'note'", (tenant[0],)).fetchone()
    assert count == (0,)
