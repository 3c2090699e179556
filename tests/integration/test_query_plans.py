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
         "job_events_after", "job_status", "ops_jobs_in_flight", "ops_budget_usage",
         "ops_job_costs")
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


# Reads of the unfinished jobs only: they must reach jobs through the partial indexes of
# unfinished jobs, never through an index of every job (a tenant's, by creation), which
# the test above lets pass and which reads a whole tenant's months of jobs.
UNFINISHED_READS = ("console_backlog", "ops_jobs_in_flight")
UNFINISHED_INDEXES = {"jobs_waiting", "jobs_running", "jobs_awaiting_review", "jobs_leased",
                      "jobs_review_deadline", "jobs_review_cap_held", "jobs_waiting_reason"}


@pytest.mark.parametrize("name", UNFINISHED_READS)
def test_reads_of_unfinished_jobs_use_only_their_partial_indexes(stack: StackState, name: str
                                                                 ) -> None:
    """console_backlog and ops_jobs_in_flight, for every tenant (the platform's console and
    the CLI), read jobs only through partial indexes of unfinished jobs (seq scans priced
    out). For one tenant the planner may take the tenant's own index where its statistics
    say the tenant has fewer jobs than are waiting: a cost choice bounded either way."""
    url = stack.env["CALMQ_DATABASE_URL"]
    statement = sql.queries()[name]
    with psycopg.connect(url) as conn:
        conn.execute("SET enable_seqscan = off")
        params = {**_params(statement, uuid.uuid4()), "tenant_id": None}
        rows = conn.execute(b"EXPLAIN " + statement.encode(), params).fetchall()
    plan = "\n".join(r[0] for r in rows)
    used = set(re.findall(r"Index (?:Only )?Scan (?:Backward )?(?:using|on) (jobs_\w+)", plan))
    assert used, plan
    assert used <= UNFINISHED_INDEXES, plan
    assert "Seq Scan on jobs " not in plan + " ", plan


def test_a_pick_from_the_waiting_room_reads_its_indexes_not_the_jobs(stack: StackState
                                                                      ) -> None:
    """A worker with fair share on picks from its lanes' waiting rooms whenever a slot frees
    (many times a second): the pick finds the waiting tenants and their oldest jobs through
    jobs_fair_waiting and the lane's running jobs through jobs_running, never by reading
    jobs whole (seq scans priced out)."""
    statement = sql.queries()["fair_share_pick"]
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        conn.execute("SET enable_seqscan = off")
        rows = conn.execute(b"EXPLAIN " + statement.encode(),
                            {"pool": "default", "priority": "bulk", "limit": 8,
                             "headroom": 4}).fetchall()
    plan = "\n".join(r[0] for r in rows)
    assert _sequential_scans(plan) == set(), plan
    used = set(re.findall(r"Index (?:Only )?Scan (?:Backward )?(?:using|on) (jobs_\w+)", plan))
    assert used <= {"jobs_fair_waiting", "jobs_running", "jobs_pkey"}, plan
    assert "jobs_fair_waiting" in used, plan


def test_the_timed_wait_release_reads_its_own_index_not_the_jobs(stack: StackState) -> None:
    """Every process with a fallback step or a key rate limit runs the timed-wait release
    twice a second: it finds the jobs whose wait is over through jobs_timed_waiting (only
    such jobs), never by reading jobs whole or the index of every waiting job (seq scans
    priced out)."""
    statement = sql.queries()["timed_wait_release_jobs"]
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        conn.execute("SET enable_seqscan = off")
        rows = conn.execute(b"EXPLAIN " + statement.encode(), {"limit": 1000}).fetchall()
    plan = "\n".join(r[0] for r in rows)
    assert _sequential_scans(plan) == set(), plan
    used = set(re.findall(r"Index (?:Only )?Scan (?:Backward )?(?:using|on) (jobs_\w+)", plan))
    assert used <= {"jobs_timed_waiting", "jobs_pkey"}, plan
    assert "jobs_timed_waiting" in used, plan


def test_the_metadata_filter_of_a_job_list_reads_an_index_not_the_jobs(stack: StackState
                                                                       ) -> None:
    """GET /v1/jobs?metadata.<key>=<value> (list_jobs_by_metadata) finds a tenant's jobs
    with that value through an index (jobs_metadata, or the tenant's by creation), never by
    reading jobs whole (seq scans priced out)."""
    from psycopg.types.json import Jsonb

    statement = sql.queries()["list_jobs_by_metadata"]
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        conn.execute("SET enable_seqscan = off")
        params = {**_params(statement, uuid.uuid4()), "metadata": Jsonb({"backfill": "x"})}
        rows = conn.execute(b"EXPLAIN " + statement.encode(), params).fetchall()
    plan = "\n".join(r[0] for r in rows)
    assert _sequential_scans(plan) == set(), plan
    assert re.search(r"(Index|Bitmap Index) Scan", plan), plan
