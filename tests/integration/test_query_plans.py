"""The reads the API, the console and the CLI offer can each be served without reading a
growing table (jobs, job_events, job_attempts and their partitions) sequentially."""

from __future__ import annotations

import re
import uuid
from typing import Any

import psycopg
import pytest

from calmq import sql
from calmq.data.console import search_terms
from calmq.tooling.devstack import StackState

pytestmark = pytest.mark.integration

# Every list, count and lookup behind GET /v1/jobs..., the console's pages and the CLI's
# jobs, dlq and operations commands.
READS = ("console_jobs", "console_reviews", "console_review", "console_job",
         "console_job_input", "console_job_events", "console_job_attempts", "console_backlog",
         "console_outcomes", "console_spend", "console_last_event", "dlq_list", "dlq_count",
         "dlq_summary", "dlq_job", "dlq_attempts", "dlq_events", "job_for_tenant",
         "job_events", "list_jobs", "ops_list_jobs", "ops_count_jobs", "job_tenant",
         "job_events_after", "job_status", "ops_jobs_in_flight", "ops_budget_usage")
GROWING = ("jobs", "job_events", "job_attempts")


def _params(statement: str, tenant: uuid.UUID) -> dict[str, Any]:
    """A value for each placeholder: a tenant and a job id where asked, bounds where the
    statement needs them, and every optional filter left out (None): the widest read."""
    given: dict[str, Any] = {"tenant_id": tenant, "id": uuid.uuid4(), "limit": 50,
                             "after": 0, "preview": 100, **search_terms(None)}
    params: dict[str, Any] = {}
    for name in re.findall(r"%\((\w+)\)s", statement):
        params[name] = 3600 if name.endswith("seconds") else given.get(name)
    return params


def _sequential_scans(plan: str) -> set[str]:
    return {table for table in GROWING for scanned in re.findall(r"Seq Scan on (\w+)", plan)
            if scanned == table or scanned.startswith(f"{table}_")}


@pytest.mark.parametrize("name", READS)
def test_read_needs_no_sequential_scan_of_a_growing_table(stack: StackState, name: str
                                                           ) -> None:
    """With sequential scans priced out (enable_seqscan off), the plan reads no growing
    table sequentially: a statement that no index can serve still shows a Seq Scan."""
    url = stack.env["CALMQ_DATABASE_URL"]
    statement = sql.queries()[name]
    with psycopg.connect(url) as conn:
        tenant = uuid.uuid4()
        conn.execute("SET enable_seqscan = off")
        rows = conn.execute(b"EXPLAIN " + statement.encode(),
                            _params(statement, tenant)).fetchall()
    plan = "\n".join(r[0] for r in rows)
    assert _sequential_scans(plan) == set(), plan
