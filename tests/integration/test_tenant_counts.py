"""Counts a tenant reads are its own (issue 27): a provider batch packs several tenants'
requests, and GET /v1/batches and /v1/batches/{id} gave every tenant with a job in it the
whole batch's request count, the provider's counts and everyone's cost."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg.types.json import Jsonb

from calmq.tooling.devstack import StackState
from tests.support.api import Api
from tests.support.workers import create_tenant_id

pytestmark = pytest.mark.integration


def _jobs(conn: psycopg.Connection, tenant: uuid.UUID, n: int) -> list[uuid.UUID]:
    ids = [uuid.uuid4() for _ in range(n)]
    for job in ids:
        conn.execute(
            "INSERT INTO jobs (id, tenant_id, workflow, workflow_version, priority, pool, step,"
            " status, attempt, max_attempts, input, metadata, lane)"
            " VALUES (%s, %s, 'summarize', 1, 'bulk', 'default', 'summarize', 'running', 1, 3,"
            " '{}', '{}', 'batch')", (job, tenant))
    return ids


def test_a_shared_batch_shows_each_tenant_only_its_own_counts_and_cost(
        stack: StackState) -> None:
    """A tenant with 2 of a batch's 5 requests sees request_count 2, its own per-state
    counts and cost, not the provider's totals or the other tenant's spend; it cannot
    cancel the shared batch."""
    url = stack.env["CALMQ_DATABASE_URL"]
    mine, key = create_tenant_id(url, f"counts-{uuid.uuid4().hex[:8]}")
    theirs, _ = create_tenant_id(url, f"counts-{uuid.uuid4().hex[:8]}")
    batch = uuid.uuid4()
    with psycopg.connect(url) as conn:
        conn.execute("INSERT INTO provider_batches (key, provider, model, endpoint, pool, state,"
                     " request_count, counts) VALUES (%s, 'openai', 'fake-small',"
                     " '/v1/chat/completions', 'default', 'submitted', 5, %s)",
                     (batch, Jsonb({"total": 5, "completed": 5})))
        rows = [(j, 1.0) for j in _jobs(conn, mine, 2)] + \
               [(j, 100.0) for j in _jobs(conn, theirs, 3)]
        for job, cost in rows:
            conn.execute("INSERT INTO batch_jobs (batch_key, job_id, attempt, custom_id, request,"
                         " state, cost_usd, online_cost_usd) VALUES (%s, %s, 1, %s, '{}',"
                         " 'settled', %s, %s)", (batch, job, f"{job}_1", cost, cost * 2))
        # Each tenant's share of the batch, as the batcher records it when it packs and
        # settles (the list reads these rows, not every batch's requests).
        conn.execute(
            "INSERT INTO batch_tenants (batch_key, tenant_id, created_at, requests, settled,"
            " cost_usd, online_cost_usd, reserved_day)"
            " SELECT bj.batch_key, j.tenant_id, b.created_at, count(*),"
            " count(*) FILTER (WHERE bj.state = 'settled'), sum(bj.cost_usd),"
            " sum(bj.online_cost_usd), current_date"
            " FROM batch_jobs bj JOIN jobs j ON j.id = bj.job_id"
            " JOIN provider_batches b ON b.key = bj.batch_key"
            " WHERE bj.batch_key = %s GROUP BY 1, 2, 3", (batch,))
    api = Api(stack.env["CALMQ_API_URL"], key)
    status, _h, listed = api.call("GET", "/v1/batches")
    assert status == 200, listed
    [seen] = [b for b in listed["batches"] if b["key"] == str(batch)]
    status, _h, shown = api.call("GET", f"/v1/batches/{batch}")
    assert status == 200, shown
    for view in (seen, shown):
        assert view["request_count"] == 2
        assert view["counts"] == {"settled": 2}
        assert view["cost_usd"] == pytest.approx(2.0)
        assert view["online_cost_usd"] == pytest.approx(4.0)
        assert "others" not in view
    assert len(shown["jobs"]) == 2
    status, _h, refused = api.call("POST", f"/v1/batches/{batch}/cancel")
    assert status == 409
    assert refused["code"] == "batch_shared"
