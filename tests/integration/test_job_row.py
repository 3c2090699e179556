"""Every statement that returns jobs returns the whole job row, on real PostgreSQL.

A statement returns jobs when its rows carry ``old_status`` (they are read as
calmq.data.jobs.Job); tests/unit/test_data_records.py holds each of them to the job_row
fragment. Here each one runs, inside a transaction that is rolled back, against a job set up
so that the statement returns it, with a value other than its column's default in every
field: the row must come back with every Job field, and with the job's own values (a
statement that dropped ``lane`` would read a batch-lane job as online).
"""

from __future__ import annotations

import re
import uuid
from dataclasses import fields
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from calmq import sql
from calmq.data import Job
from calmq.tooling.devstack import StackState

pytestmark = pytest.mark.integration

LONG_AGO = "2000-01-01T00:00:00Z"
WORKER = "job-row-test"

# What each statement needs of the job to return it: the columns set on insert, beyond the
# ones every job here has.
SETUP: dict[str, dict[str, Any]] = {
    "claim_jobs": {"status": "queued"},
    "reap_expired_leases": {"status": "running", "lease_owner": WORKER,
                            "lease_expires_at": LONG_AGO},
    "poison_expired_leases": {"status": "running", "lease_owner": WORKER,
                              "lease_expires_at": LONG_AGO, "attempt": 3},
    "sweep_stranded_jobs": {"status": "queued"},
    "release_jobs": {"status": "queued", "waiting_reason": "spend_cap_daily"},
    "release_quota_jobs": {"status": "queued", "waiting_reason": "token_quota"},
    "release_review_cap_holds": {"status": "queued", "review_cap_held_at": LONG_AGO},
    "batch_pending_jobs": {"status": "running"},
    "batch_hand_back": {"status": "running", "waiting_reason": "provider_blocked"},
    "provider_release_jobs": {"status": "queued", "waiting_reason": "provider_blocked"},
    "fair_share_release_stale": {"status": "queued", "waiting_reason": "fair_share"},
    "concurrency_release": {"status": "queued", "waiting_reason": "concurrency_key",
                            "concurrency_key": "customer-1"},
    "timed_wait_release_jobs": {"status": "queued", "waiting_reason": "model_cooldown",
                                "waiting_until": LONG_AGO},
}


def _params(query: str, job_id: uuid.UUID, tenant_id: uuid.UUID, key: uuid.UUID
            ) -> dict[str, Any]:
    """A value for each placeholder the statement has (one it does not know fails)."""
    values: dict[str, Any] = {
        "ids": [job_id], "worker": WORKER, "lease_seconds": 30.0, "steps": None,
        "limit": 100_000, "error": Jsonb({"code": "poison", "class": "input", "message": "x"}),
        "keep_errors": 20, "grace_seconds": 1.0, "longest_tier_seconds": 1.0,
        "held_bulk": [], "held_all": [], "fleet_bulk": False, "fleet_all": False,
        "stale_seconds": 1.0, "tenant_id": tenant_id, "key": key,
        "owner": f"batch:{key}", "custom_ids": None, "workflows": ["summarize"],
        "waiting_reason": "provider_blocked", "detail": Jsonb({"reason": "provider_blocked"}),
        "limits": "{}", "admitted_seconds": 30.0, "known": ["summarize"],
        # the keys concurrency_lock_held locked: the job's own (SETUP)
        "tenants": [tenant_id], "keys": ["customer-1"]}
    wanted = set(re.findall(r"%\((\w+)\)s", query))
    unknown = wanted - set(values)
    assert not unknown, f"no test value for {sorted(unknown)}"
    return {name: values[name] for name in wanted}


def _returned(conn: psycopg.Connection[Any], name: str, query: str
              ) -> tuple[list[str], dict[str, Any] | None, dict[str, Any]]:
    """The statement's column names, its row for the test's job, and that job's values."""
    job_id, tenant_id, key = uuid.uuid4(), uuid.uuid4(), uuid.uuid4()
    setup = SETUP[name]
    job = {"id": job_id, "tenant_id": tenant_id, "workflow": "summarize",
           "workflow_version": 7, "priority": "interactive", "pool": "rowpool",
           "step": "summarize", "attempt": setup.get("attempt", 1), "max_attempts": 3,
           "input": Jsonb({"text": "row"}), "input_ref": "file:///x", "metadata":
           Jsonb({"k": "v"}), "deadline_at": "2999-01-01T00:00:00Z",
           "trace_parent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
           "created_at": LONG_AGO, "updated_at": LONG_AGO, "lease_version": 5,
           "lane": "batch", **setup}
    if name in ("batch_pending_jobs", "batch_hand_back"):
        job["lease_owner"] = f"batch:{key}"
    with conn.transaction(force_rollback=True):
        conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s)",
                     (tenant_id, f"row-{tenant_id.hex[:12]}"))
        columns = ", ".join(job)
        marks = ", ".join(f"%({c})s" for c in job)
        conn.execute(f"INSERT INTO jobs ({columns}) VALUES ({marks})", job)
        if name in ("batch_pending_jobs", "batch_hand_back"):
            conn.execute(
                "INSERT INTO provider_batches (key, provider, model, endpoint, pool,"
                " request_count, input_bytes, enqueued_tokens) VALUES"
                " (%s, 'openai', 'm', '/v1/chat/completions', 'rowpool', 1, 1, 1)", (key,))
            conn.execute("INSERT INTO batch_jobs (batch_key, job_id, attempt, custom_id,"
                         " request) VALUES (%s, %s, 1, 'c1', '{}')", (key, job_id))
        cur = conn.execute(query, _params(query, job_id, tenant_id, key))
        names = [d.name for d in cur.description or []]
        mine = next((r for r in cur.fetchall() if r["id"] == job_id), None)
    expected = {k: v.obj if isinstance(v, Jsonb) else v for k, v in job.items()}
    return names, mine, expected


def _job_statements() -> list[str]:
    return sorted(name for name, (kind, text) in sql.sources().items()
                  if kind == "name" and "old_status" in text)


@pytest.fixture(scope="module")
def database(stack: StackState) -> str:
    return stack.env["CALMQ_DATABASE_URL"]


def test_every_statement_that_returns_jobs_is_set_up_here() -> None:
    """The statements read as Job are the ones this test knows how to run."""
    assert _job_statements() == sorted(SETUP)


@pytest.mark.parametrize("name", sorted(SETUP))
def test_the_statement_returns_every_job_field_with_the_jobs_values(
        database: str, name: str) -> None:
    """The statement's columns include every Job field, and its row for a job carries that
    job's own values in each of them (the claim moves attempt and lease_version on)."""
    with psycopg.connect(database, row_factory=dict_row) as conn:
        names, row, job = _returned(conn, name, sql.queries()[name])
    wanted = [f.name for f in fields(Job)]
    assert [n for n in wanted if n not in names] == [], name
    assert row is not None, f"{name} did not return the job set up for it"
    got = Job.from_row({n: row[n] for n in wanted})
    # The claim moves attempt and lease_version on; a hand-back takes the attempt back.
    moved = {"claim_jobs": {"attempt", "lease_version"},
             "batch_hand_back": {"attempt"}}.get(name, set())
    for field in wanted:
        # (a field this test does not set yet is held to being returned, above)
        if field in moved or field not in job or field in ("old_status", "created_at",
                                                            "deadline_at"):
            continue
        assert getattr(got, field) == job[field], (name, field)
    assert got.created_at.year == 2000
    assert got.deadline_at is not None
    assert got.deadline_at.year == 2999
    assert got.old_status == job["status"]
