"""The state machine's table (calmq.jobs.MOVES) and the SQL guards agree, on real PostgreSQL.

Every statement that changes a job's status runs against a job in each status, inside a
transaction that is rolled back (nothing commits: no relay, no worker sees these jobs). A
statement moved the job when it touched ``updated_at``; the pairs that moved must be exactly
the table's moves.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from calmq.data import Database, Finish
from calmq.jobs import MOVES, Status
from calmq.tooling.devstack import StackState

pytestmark = pytest.mark.integration

WORKER = "moves-test-worker"
LONG_AGO = "2000-01-01T00:00:00Z"

# One statement per way a job's status changes: (the status it sets, its parameters).
Statement = tuple[str, Status, Callable[[uuid.UUID, uuid.UUID], dict[str, Any]]]


def _finish(status: Status, **kw: Any) -> Callable[[uuid.UUID, uuid.UUID], dict[str, Any]]:
    def params(job_id: uuid.UUID, _tenant_id: uuid.UUID) -> dict[str, Any]:
        outcome = Finish(job_id=job_id, worker=WORKER, step="s", attempt=1, status=status,
                         event_type="test", outcome="test", **kw)
        return {"rows": Jsonb([outcome.row(0)]), "keep_errors": 20}
    return params


STATEMENTS: list[Statement] = [
    ("claim_jobs", Status.RUNNING, lambda j, _t: {
        "ids": [j], "worker": "another-worker", "lease_seconds": 30.0, "steps": None}),
    ("finish_attempts", Status.COMPLETED, _finish(Status.COMPLETED)),
    ("finish_attempts", Status.RETRYING, _finish(Status.RETRYING)),
    ("finish_attempts", Status.DEAD_LETTER, _finish(Status.DEAD_LETTER,
                                                    error={"code": "x", "class": "bug"})),
    ("finish_attempts", Status.AWAITING_REVIEW, _finish(Status.AWAITING_REVIEW)),
    ("finish_attempts", Status.QUEUED, _finish(Status.QUEUED, next_step="s2",
                                               reset_attempt=True)),
    ("reap_expired_leases", Status.QUEUED, lambda _j, _t: {"limit": 500}),
    ("poison_expired_leases", Status.DEAD_LETTER, lambda _j, _t: {
        "limit": 500, "error": Jsonb({"code": "poison", "class": "input"}),
        "keep_errors": 20}),
    ("cancel_job", Status.CANCELLED, lambda j, t: {"id": j, "tenant_id": t, "by": None}),
    ("dlq_requeue", Status.QUEUED, lambda j, _t: {
        "id": j, "detail": Jsonb({}), "workflow_version": 1, "pool": "default",
        "max_attempts": 3}),
    ("wf_review_resume", Status.QUEUED, lambda j, _t: {
        "id": j, "next_step": "s2", "pool": "default", "max_attempts": 3}),
    ("wf_review_complete", Status.COMPLETED, lambda j, _t: {"id": j, "artifact": Jsonb({})}),
    ("wf_review_dead_letter", Status.DEAD_LETTER, lambda j, _t: {
        "id": j, "error": Jsonb({"code": "rejected", "class": "policy"}), "keep_errors": 20}),
]


# Statements that act on a job at its attempt cap (attempt >= max_attempts) alone.
AT_CAP = frozenset({"poison_expired_leases"})


def _moved(conn: psycopg.Connection[Any], query: str, source: Status,
           params: Callable[[uuid.UUID, uuid.UUID], dict[str, Any]], *,
           at_cap: bool = False) -> bool:
    """Whether ``query`` moves a job that is in ``source`` (rolled back either way)."""
    job_id, tenant_id = uuid.uuid4(), uuid.uuid4()
    with conn.transaction(force_rollback=True):
        conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s)",
                     (tenant_id, f"moves-{tenant_id.hex[:12]}"))
        running = source is Status.RUNNING
        # A running job's lease expired long ago: every statement that may take it over
        # (claim, reap) can, and its holder may still finish it.
        conn.execute(
            "INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority,"
            " pool, step, attempt, max_attempts, input, lease_owner, lease_expires_at,"
            " updated_at)"
            " VALUES (%s, %s, 'summarize', 1, %s, 'bulk', 'default', 's', 1, %s, '{}',"
            " %s, %s, %s)",
            (job_id, tenant_id, source.value, 1 if at_cap else 3, WORKER if running else None,
             LONG_AGO if running else None, LONG_AGO))
        conn.execute(query, params(job_id, tenant_id))
        row = conn.execute("SELECT updated_at > %s AS moved FROM jobs WHERE id = %s",
                           (LONG_AGO, job_id)).fetchone()
    assert row is not None
    return bool(row["moved"])


def _join_failed(conn: psycopg.Connection[Any], source: Status) -> bool:
    """Whether a child's dead letter, failing its parent's join, moves a parent in
    ``source`` (the trigger calmq_settle_child; rolled back either way)."""
    parent, child, tenant_id = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    with conn.transaction(force_rollback=True):
        conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s)",
                     (tenant_id, f"moves-{tenant_id.hex[:12]}"))
        for job, status, parent_id in ((parent, source, None), (child, Status.RUNNING, parent)):
            conn.execute(
                "INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority,"
                " pool, step, max_attempts, input, waiting_reason, parent_id, child_index,"
                " parent_step, updated_at) VALUES (%s, %s, 'summarize', 1, %s, 'bulk',"
                " 'default', 's', 3, '{}', %s, %s, %s, %s, %s)",
                (job, tenant_id, status.value, "children" if parent_id is None else None,
                 parent_id, 0 if parent_id else None, "s" if parent_id else None, LONG_AGO))
        conn.execute("INSERT INTO job_joins (parent_id, step, policy, k, n, resume_outbox,"
                     " fail_outbox) VALUES (%s, 's', 'all', 1, 1, '[]', '[]')", (parent,))
        conn.execute("UPDATE jobs SET status = 'dead_letter' WHERE id = %s", (child,))
        row = conn.execute("SELECT updated_at > %s AS moved FROM jobs WHERE id = %s",
                           (LONG_AGO, parent)).fetchone()
    assert row is not None
    return bool(row["moved"])


@pytest.fixture(scope="module")
def performed(stack: StackState) -> set[tuple[Status, Status]]:
    """Every (from, to) pair that some guarded statement performs."""
    url = stack.env["CALMQ_DATABASE_URL"]
    q = Database(url).q
    found: set[tuple[Status, Status]] = set()
    with psycopg.connect(url, row_factory=dict_row) as conn:
        for name, target, params in STATEMENTS:
            for source in Status:
                if _moved(conn, q[name], source, params, at_cap=name in AT_CAP):
                    found.add((source, target))
        found |= {(source, Status.DEAD_LETTER) for source in Status
                  if _join_failed(conn, source)}
    return found


def test_no_guard_allows_a_move_the_table_forbids(performed: set[tuple[Status, Status]]) -> None:
    """Each status-changing statement leaves alone a job whose move the table forbids."""
    assert sorted(performed - MOVES) == []


def test_every_move_of_the_table_has_a_guarded_statement(
        performed: set[tuple[Status, Status]]) -> None:
    """Each move the table declares is made by a statement whose guard lets it through."""
    assert sorted(MOVES - performed) == []
