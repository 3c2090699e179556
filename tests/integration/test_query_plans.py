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
from tests.support.cli import new_tenant

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
    the room's functions (calmq_fair_next_tenant, calmq_fair_oldest: jobs_fair_waiting, the
    next test), the lane's running jobs through jobs_running and the chosen ones by key,
    never by reading jobs whole (seq scans priced out)."""
    statement = sql.queries()["fair_share_pick"]
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        conn.execute("SET enable_seqscan = off")
        rows = conn.execute(b"EXPLAIN " + statement.encode(),
                            {"pool": "default", "priority": "bulk", "limit": 8,
                             "headroom": 4}).fetchall()
    plan = "\n".join(r[0] for r in rows)
    assert _sequential_scans(plan) == set(), plan
    used = set(re.findall(r"Index (?:Only )?Scan (?:Backward )?(?:using|on) (jobs_\w+)", plan))
    assert used <= {"jobs_running", "jobs_pkey"}, plan
    assert "Function Scan on calmq_fair_oldest" in plan, plan


ROOM = 20_000


def _pages(conn: psycopg.Connection[Any], statement: str, params: dict[str, Any]) -> int:
    """Pages a statement touched (shared buffers hit or read, functions' reads included),
    run under EXPLAIN ANALYZE in a transaction that is rolled back (a pick updates rows).
    The second run's: the first of a session also reads the catalogs to compile the
    functions, which a worker does once."""
    pages = 0
    for _ in range(2):
        with conn.transaction(force_rollback=True):
            row = conn.execute(b"EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) "
                               + statement.encode(), params).fetchone()
        assert row is not None
        top = row[0][0]["Plan"]
        pages = int(top["Shared Hit Blocks"]) + int(top["Shared Read Blocks"])
    return pages


def test_the_waiting_room_is_read_through_its_index_whatever_the_statistics(
        stack: StackState) -> None:
    """The look into a room (fair_share_waiting) and the pick read the room through
    jobs_fair_waiting whatever the statistics of jobs say (migration 0061). Written as plain
    queries, the planner's choice followed them: with statistics taken before a backlog
    moved into a bulk room, the pick read a tenant's room through another index and sorted
    it; taken after, a look into the empty interactive room beside it scanned jobs whole.
    Here, with 20,000 jobs in a bulk room, each reads a few dozen pages either way, where
    those plans read thousands."""
    tenant = new_tenant(stack, "room-plan")[1]
    pool = f"plan{uuid.uuid4().hex[:6]}"
    url = stack.env["CALMQ_DATABASE_URL"]
    queries = sql.queries()
    with psycopg.connect(url, autocommit=True) as conn:
        try:
            conn.execute("ANALYZE jobs")  # statistics of no waiting room: taken "before"
            conn.execute(
                """INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status,
                                     priority, pool, step, max_attempts, input, metadata,
                                     waiting_reason, created_at)
                   SELECT gen_random_uuid(), %s, 'summarize', 1, 'queued', 'bulk', %s,
                          'summarize', 3, '{}'::jsonb, '{}'::jsonb, 'fair_share',
                          now() - make_interval(secs => %s - g)
                   FROM generate_series(1, %s) g""", (tenant, pool, ROOM, ROOM))
            for statistics in ("before the backlog", "after it"):
                if statistics == "after it":
                    conn.execute("ANALYZE jobs")
                look = _pages(conn, queries["fair_share_waiting"],
                              {"pool": pool, "priority": "interactive"})
                pick = _pages(conn, queries["fair_share_pick"],
                              {"pool": pool, "priority": "bulk", "limit": 8, "headroom": 0})
                assert look <= 20, f"the look, statistics {statistics}: {look} pages"
                assert pick <= 300, f"the pick, statistics {statistics}: {pick} pages"
        finally:
            conn.execute("DELETE FROM jobs WHERE pool = %s", (pool,))


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
