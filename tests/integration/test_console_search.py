"""The console's job search (console_jobs): a job id prefix or a metadata value, found
through indexes rather than by reading each of a tenant's jobs."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import psycopg
import pytest

from calmq.data import Store
from calmq.data.console import ConsoleReads, JobQuery, search_terms
from calmq.tooling.devstack import StackState

pytestmark = pytest.mark.integration


def _job(conn: psycopg.Connection[Any], tenant: uuid.UUID, metadata: dict[str, Any]) -> str:
    job = uuid.uuid4()
    conn.execute(
        "INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority, pool,"
        " step, max_attempts, metadata) VALUES (%s, %s, 'summarize', 1, 'completed', 'bulk',"
        " 'default', 'summarize', 3, %s)", (job, tenant, json.dumps(metadata)))
    return str(job)


async def _search(url: str, tenant: uuid.UUID, search: str) -> list[str]:
    store = Store(url, max_size=1)
    await store.open()
    try:
        found = await ConsoleReads(store).jobs(JobQuery(tenant, search=search))
    finally:
        await store.close()
    return sorted(str(j.id) for j in found)


def test_search_finds_jobs_by_id_prefix_and_by_metadata_value_within_the_tenant(
        stack: StackState) -> None:
    """An id prefix finds its job; a metadata value (text, or a number) finds the jobs that
    carry it as any key's value, and none of another tenant."""
    url = stack.env["CALMQ_DATABASE_URL"]
    mine, other = uuid.uuid4(), uuid.uuid4()
    value = f"order-{uuid.uuid4().hex[:8]}"
    with psycopg.connect(url, autocommit=True) as conn:
        for t in (mine, other):
            conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s)", (t, f"s-{t.hex}"))
        tagged = _job(conn, mine, {"order": value, "n": 7})
        also = _job(conn, mine, {"ref": value})
        plain = _job(conn, mine, {"order": "something else"})
        _job(conn, other, {"order": value})
    assert asyncio.run(_search(url, mine, value)) == sorted([tagged, also])
    assert asyncio.run(_search(url, mine, plain[:8])) == [plain]
    assert asyncio.run(_search(url, mine, plain)) == [plain]
    assert tagged in asyncio.run(_search(url, mine, "7"))
    assert asyncio.run(_search(url, mine, "no such value")) == []


def test_search_plan_finds_jobs_through_the_metadata_index_and_the_primary_key(
        stack: StackState) -> None:
    """For every tenant at once (a platform key), a metadata search is a scan of the GIN
    index jobs_metadata and an id prefix a range of the primary key: neither reads the jobs
    one by one (plans are taken with whole-table and ordered walks priced out, so a
    statement no index can serve would show a Seq Scan on jobs)."""
    url = stack.env["CALMQ_DATABASE_URL"]
    statement = Store(url, max_size=1).q["console_jobs"]

    def plan(search: str) -> str:
        params = {"tenant_id": None, "statuses": None, "workflow": None,
                  "pool": None, "priority": None, "lane": None, "created_after": None,
                  "created_before": None, "search": search, "limit": 50,
                  **search_terms(search)}
        with psycopg.connect(url) as conn:
            conn.execute("SET enable_seqscan = off")
            conn.execute("SET enable_indexscan = off")
            rows = conn.execute(b"EXPLAIN " + statement.encode(), params).fetchall()
        return "\n".join(r[0] for r in rows)

    by_value = plan("order-42")
    assert "Seq Scan on jobs" not in by_value, by_value
    assert "Bitmap Index Scan on jobs_metadata" in by_value, by_value
    by_id = plan("5ca1e")
    assert "Seq Scan on jobs" not in by_id, by_id
    assert "Bitmap Index Scan on jobs_pkey" in by_id, by_id
    assert "Bitmap Index Scan on jobs_metadata" in by_id, by_id
