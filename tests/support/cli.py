"""Running ``calmq`` against the session's stack, and jobs made straight in PostgreSQL.

Jobs written here have no outbox row, so no worker ever sees them until a command under
test acts on them (a redrive or a cancel writes its own outbox row): hundreds of dead
letters or queued jobs in a few milliseconds, on the ``default`` pool whose topics exist.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import Jsonb

from calmq.tooling.devstack import StackState
from tests.support.api import create_tenant

__all__ = ["calmq", "calmq_argv", "calmq_env", "insert_jobs", "new_tenant", "redriven_counts"]


def calmq_env(stack: StackState, **extra: str) -> dict[str, str]:
    """The environment of a calmq subprocess: the stack's CALMQ_* and nothing stale."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
    env.update(stack.env)
    env.update(extra)
    return env


def calmq_argv(*argv: str) -> list[str]:
    return [sys.executable, "-m", "calmq.cli", *argv]


def calmq(stack: StackState, *argv: str, env: Mapping[str, str] | None = None,
          timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``calmq ARGV`` to its end, stdin not a terminal (a script or CI job)."""
    return subprocess.run(calmq_argv(*argv), env=dict(env or calmq_env(stack)),
                          stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout, check=False)


def new_tenant(stack: StackState, prefix: str) -> tuple[str, uuid.UUID, str]:
    """A fresh tenant: (name, id, API key); a test filters by its name to see only its jobs."""
    name = f"{prefix}-{uuid.uuid4().hex[:8]}"
    key = create_tenant(stack.env["CALMQ_DATABASE_URL"], name)
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        row = conn.execute("SELECT id FROM tenants WHERE name = %s", (name,)).fetchone()
    assert row is not None
    return name, row[0], key


def insert_jobs(stack: StackState, tenant_id: uuid.UUID, n: int, *, status: str = "dead_letter",
                workflow: str = "summarize", code: str = "malformed_output",
                failure_class: str = "verifier", input_: dict[str, Any] | None = None,
                pool: str = "default") -> list[uuid.UUID]:
    """``n`` jobs in ``status`` (a dead letter carries ``error``), each dead-lettered (or
    created) a millisecond after the previous one, all in the past."""
    ids = [uuid.uuid4() for _ in range(n)]
    dead = status == "dead_letter"
    error = {"class": failure_class, "code": code, "message": "made by the test"} if dead else None
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"]) as conn:
        conn.execute(
            """
            WITH src AS (
                SELECT id, ord FROM unnest(%(ids)s::uuid[]) WITH ORDINALITY AS u(id, ord)
            ), job AS (
                INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority,
                                  pool, step, attempt, max_attempts, input, error, created_at,
                                  updated_at)
                SELECT id, %(tenant)s, %(workflow)s, 1, %(status)s, 'bulk', %(pool)s,
                       'summarize', %(attempt)s, 3, %(input)s, %(error)s,
                       now() - interval '10 minutes' + ord * interval '1 millisecond',
                       now() - interval '5 minutes' + ord * interval '1 millisecond'
                FROM src
                RETURNING id
            )
            INSERT INTO job_events (job_id, type, attempt, detail)
            SELECT id, 'queued', 0, '{}'::jsonb FROM job
            UNION ALL
            SELECT id, 'dead_lettered', 1, '{}'::jsonb FROM job WHERE %(dead)s
            """,
            {"ids": ids, "tenant": tenant_id, "workflow": workflow, "status": status,
             "attempt": 1 if dead else 0, "dead": dead, "pool": pool,
             "input": Jsonb(input_ or {"text": "made by the test", "mode": "success"}),
             "error": Jsonb(error) if error else None})
    return ids


def redriven_counts(stack: StackState, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, int]:
    """How many ``redriven`` history events each job has (0 included)."""
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"], row_factory=dict_row) as conn:
        rows = conn.execute(
            "SELECT j.id, count(e.id) AS n FROM jobs j"
            " LEFT JOIN job_events e ON e.job_id = j.id AND e.type = 'redriven'"
            " WHERE j.id = ANY(%s) GROUP BY j.id", (list(ids),)).fetchall()
    return {r["id"]: int(r["n"]) for r in rows}


def statuses(stack: StackState, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, str]:
    with psycopg.connect(stack.env["CALMQ_DATABASE_URL"], row_factory=dict_row) as conn:
        rows = conn.execute("SELECT id, status FROM jobs WHERE id = ANY(%s)",
                            (list(ids),)).fetchall()
    return {r["id"]: str(r["status"]) for r in rows}
