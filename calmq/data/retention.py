"""Deleting tenant data: redacting a terminal job's row and everything recorded about it, and
what is past its retention (old terminal jobs, old idempotency keys). The order of work
(objects first, then the rows) is calmq.producers.retention's.

Two ways, one coverage: a purge on request (``redact``: DELETE /v1/jobs/{id}, a tenant's
deletion) clears one job everywhere at once, its history rows included; the retention sweep
(``expired`` then ``redact_expired``) clears a batch of jobs past retention with one
statement per table, and leaves their history rows to go whole with their time partitions
(calmq.data.partitions), which it drops once every job in them is past retention.

``COVERAGE`` says, for every table that holds a job's or a tenant's data, what a purge does
to it. tests/integration/test_deletion_coverage.py reads the database's catalog and fails
when a table with a ``job_id`` or ``tenant_id`` column is missing here: a new table must be
given a line (and, if it holds job data, a statement in ``_REDACTIONS``).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from calmq.data.database import Database

__all__ = ["COVERAGE", "ExpiredJob", "JobData", "Retention"]

# table -> how a purge handles it. "deleted": the job's rows go; "redacted: ...": those
# columns are cleared, the rest (ids, times, statuses, token and cost numbers: accounting
# and audit) stays; "kept: ...": why the table holds nothing of a job's data.
COVERAGE: dict[str, str] = {
    "jobs": "redacted: input, input_ref, metadata, callback_url, artifact, error message, "
            "errors (kept: ids, workflow, status, step, attempts, times, tokens, cost)",
    "job_events": "redacted by a purge: detail (kept: type, time, attempt: the history's "
                  "shape); past retention the rows go with their time partition",
    "job_attempts": "redacted by a purge: error_message (kept: worker, times, outcome, error "
                    "code and class, model calls, tokens, cost); past retention the rows go "
                    "with their time partition",
    "job_attempts_redriven": "redacted: record.error_message (kept: the rest of the record)",
    "step_outputs": "redacted: output, model_output (kept: state, confidence, reviewer, times)",
    "side_effects": "redacted: response (kept: key, state, calls, times)",
    "webhook_deliveries": "redacted: url ('' ; a pending delivery ends failed)",
    "webhook_attempts": "redacted: error (kept: status code, time, duration); rows found by "
                        "their delivery's job_id",
    "idempotency_keys": "deleted (the key is the tenant's text, the hash covers the body)",
    "job_output_chunks": "deleted (a streamed step's text as the model wrote it)",
    "job_outputs": "deleted (a streamed step's text, compacted once the job was final)",
    "job_followers": "kept: which event streams follow the job now (random ids and an "
                     "expiry), no job data; each row goes when its stream ends or expires",
    "outbox": "deleted: rows whose aggregateid is the job (the relay prunes published ones)",
    "batch_jobs": "redacted: request (kept: batch, attempt, custom_id, state, tokens, cost); "
                  "the provider's copies: its batches are due for a poller at once, which "
                  "deletes their files at the provider (an open batch none of whose jobs "
                  "still waits is cancelled there first)",
    "batch_tenants": "kept: each tenant's share of a provider batch (request counts by "
                     "state, cost, what is reserved against its spend caps), no job data",
    "job_held_children": "kept: a child job waiting for its parent's in-flight limit: its "
                         "id, its parent's and a job.requested of references (ids, workflow, "
                         "pool; no input, no metadata); the row goes when it is released",
    "api_keys": "kept: the tenant's keys (hash and prefix), no job data",
    "tenants": "kept: the tenant itself, no job data",
    "tenant_token_buckets": "kept: the tenant's token quota level (a number), no job data",
    "spend_days": "kept: the tenant's cost per UTC day (a sum, accounting), no job data",
    "spend_deltas": "kept: cost changes per tenant and day waiting to be folded into "
                    "spend_days (sums, accounting), no job data",
    "spend_hours": "kept: the tenant's tokens and cost per UTC hour of the last 8 days "
                   "(sums, the console's overview), no job data",
    "spend_hour_deltas": "kept: token and cost changes per tenant and hour waiting to be "
                         "folded into spend_hours (sums), no job data",
    "finish_bins": "kept: the tenant's jobs finished and their cost per 5 minutes of the "
                   "last 8 days (counts and sums, the console's overview), no job data",
    "finish_bin_deltas": "kept: jobs finished per tenant and 5 minutes waiting to be folded "
                         "into finish_bins (counts and sums), no job data",
    "key_rate_buckets": "kept: a concurrency key's request and token levels (numbers), no "
                        "job data; the key is the tenant's text (a customer id), and the "
                        "row goes a day after the key's last call (calmq.calls.key_rates)",
}

# The statements of calmq/sql/retention.sql that redact or delete a job's rows, in order,
# after retention_redact_job (in its transaction).
_REDACTIONS = (
    "retention_redact_events",
    "retention_redact_attempts",
    "retention_redact_redriven",
    "retention_redact_step_outputs",
    "retention_redact_side_effects",
    "retention_redact_webhook_attempts",
    "retention_redact_webhooks",
    "retention_delete_idempotency_keys",
    "retention_delete_outputs",
    "retention_delete_outbox",
    "retention_redact_batch_jobs",
    "retention_batches_due",
)


@dataclass(frozen=True, slots=True)
class JobData:
    """What a purge needs to know of a job: whether it may go, and the objects it names."""

    status: str
    input_ref: str | None
    artifact: dict[str, Any] | None
    redacted_at: datetime | None
    steps: list[str] = field(default_factory=list)  # steps that recorded an output
    # (step, lease_version) of every attempt: each may have written an artifact of its own.
    attempts: list[tuple[str, int]] = field(default_factory=list)
    documents: list[Any] = field(default_factory=list)  # JSON that may name objects

    def object_uris(self) -> set[str]:
        """Every ``uri`` the job's input reference, artifact and step outputs name (an
        embed_document artifact names its vectors one level down, a step output its chunks)."""
        found: set[str] = set()
        if self.input_ref:
            found.add(self.input_ref)
        stack: list[Any] = [self.artifact, *self.documents]
        while stack:
            value = stack.pop()
            if isinstance(value, dict):
                uri = value.get("uri")
                if isinstance(uri, str) and uri:
                    found.add(uri)
                stack.extend(value.values())
            elif isinstance(value, list):
                stack.extend(value)
        return found


# The statements of calmq/sql/retention.sql that clear a batch of jobs past retention, in
# order, after retention_redact_jobs (in its transaction). Not job_events and job_attempts:
# their partitions are dropped whole.
_BATCH_REDACTIONS = (
    "retention_redact_many_redriven",
    "retention_redact_many_step_outputs",
    "retention_redact_many_side_effects",
    "retention_redact_many_webhook_attempts",
    "retention_redact_many_webhooks",
    "retention_delete_many_idempotency_keys",
    "retention_delete_many_outputs",
    "retention_delete_many_outbox",
    "retention_redact_many_batch_jobs",
    "retention_many_batches_due",
)


@dataclass(frozen=True, slots=True)
class ExpiredJob:
    """A terminal job past retention, as the retention sweep reads it: its data, and its
    lifetime (the history partitions its attempts may lie in)."""

    tenant_id: uuid.UUID
    job_id: uuid.UUID
    data: JobData
    created_at: datetime
    updated_at: datetime


class Retention:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def job_data(self, tenant_id: uuid.UUID, job_id: uuid.UUID) -> JobData | None:
        """The tenant's job as a purge sees it; None for another tenant's or no job."""
        params = {"id": job_id, "tenant_id": tenant_id}
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["job_status"], params)
            row = await cur.fetchone()
            if row is None:
                return None
            cur = await conn.execute(self._db.q["retention_job_documents"], params)
            outputs = await cur.fetchall()
            cur = await conn.execute(self._db.q["retention_job_attempt_versions"], params)
            attempts = [(a["step"], int(a["lease_version"])) for a in await cur.fetchall()]
        return JobData(row["status"], row["input_ref"], row["artifact"], row["redacted_at"],
                       steps=[o["step"] for o in outputs], attempts=attempts,
                       documents=[d for o in outputs for d in (o["output"], o["model_output"])])

    async def redact(self, tenant_id: uuid.UUID, job_id: uuid.UUID) -> bool:
        """Drop a terminal job's data everywhere it is recorded (``COVERAGE``), keeping its
        status, times and accounting; False when it is not the tenant's terminal job."""
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._db.q["retention_redact_job"],
                                     {"id": job_id, "tenant_id": tenant_id})
            if await cur.fetchone() is None:
                return False
            for name in _REDACTIONS:
                await conn.execute(self._db.q[name], {"id": job_id})
        return True

    async def prune_idempotency_keys(self, retention_seconds: float) -> int:
        """Delete idempotency keys older than the retention; returns how many."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["retention_prune_idempotency_keys"],
                                     {"retention_seconds": retention_seconds})
            return cur.rowcount

    async def expired(self, retention_seconds: float, limit: int) -> list[ExpiredJob]:
        """Up to ``limit`` terminal jobs past retention that still hold data, oldest first,
        each with what its purge reads (three statements for the whole batch)."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["retention_expired_jobs"],
                                     {"retention_seconds": retention_seconds, "limit": limit})
            return await self._with_data(conn, await cur.fetchall())

    async def tree(self, tenant_id: uuid.UUID, job_id: uuid.UUID) -> list[uuid.UUID]:
        """Every descendant of the tenant's job (children, theirs, ...), deepest first."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["retention_tree"],
                                     {"id": job_id, "tenant_id": tenant_id})
            return [r["id"] for r in await cur.fetchall()]

    async def jobs_data(self, tenant_id: uuid.UUID, job_ids: list[uuid.UUID]
                        ) -> list[ExpiredJob]:
        """What a purge reads of each of a batch of the tenant's jobs (three statements)."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["retention_jobs_by_id"],
                                     {"ids": job_ids, "tenant_id": tenant_id})
            return await self._with_data(conn, await cur.fetchall())

    async def redact_tree(self, tenant_id: uuid.UUID, job_ids: list[uuid.UUID]
                          ) -> list[uuid.UUID]:
        """``redact`` for a batch of the tenant's jobs (a deleted job's descendants), in one
        transaction, a statement per table for the whole batch; returns the ids redacted
        (a job not terminal is not)."""
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._db.q["retention_redact_tree_jobs"],
                                     {"ids": job_ids, "tenant_id": tenant_id})
            rows = await cur.fetchall()
            if not rows:
                return []
            redacted = [r["id"] for r in rows]
            since = min(r["created_at"] for r in rows)
            for name in ("retention_redact_many_events", "retention_redact_many_attempts"):
                await conn.execute(self._db.q[name], {"ids": redacted, "since": since})
            for name in _BATCH_REDACTIONS:
                await conn.execute(self._db.q[name], {
                    "ids": [str(i) for i in redacted] if name.endswith("outbox")
                    else redacted})
        return redacted

    async def _with_data(self, conn: Any, rows: list[Any]) -> list[ExpiredJob]:
        """``rows`` (retention_expired_jobs' columns), each with its step outputs and its
        attempts' fencing tokens, read for the whole batch in two statements."""
        if not rows:
            return []
        ids = [r["id"] for r in rows]
        cur = await conn.execute(self._db.q["retention_jobs_documents"], {"ids": ids})
        outputs = await cur.fetchall()
        cur = await conn.execute(self._db.q["retention_jobs_attempt_versions"], {
            "ids": ids, "since": min(r["created_at"] for r in rows),
            "until": max(r["updated_at"] for r in rows)})
        versions = await cur.fetchall()
        steps: dict[uuid.UUID, list[str]] = {i: [] for i in ids}
        documents: dict[uuid.UUID, list[Any]] = {i: [] for i in ids}
        for o in outputs:
            steps[o["job_id"]].append(o["step"])
            documents[o["job_id"]] += [o["output"], o["model_output"]]
        attempts: dict[uuid.UUID, list[tuple[str, int]]] = {i: [] for i in ids}
        for a in versions:
            attempts[a["job_id"]].append((a["step"], int(a["lease_version"])))
        return [ExpiredJob(r["tenant_id"], r["id"],
                           JobData(r["status"], r["input_ref"], r["artifact"], r["redacted_at"],
                                   steps=steps[r["id"]], attempts=attempts[r["id"]],
                                   documents=documents[r["id"]]),
                           r["created_at"], r["updated_at"])
                for r in rows]

    async def redact_expired(self, job_ids: list[uuid.UUID]) -> int:
        """Clear the data of terminal jobs past retention (``expired``; their objects deleted
        first) in one transaction, every table of ``COVERAGE`` but the history, whose
        partitions go whole; returns how many jobs were redacted."""
        params = {"ids": job_ids}
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._db.q["retention_redact_jobs"], params)
            redacted = [r["id"] for r in await cur.fetchall()]
            if redacted:
                for name in _BATCH_REDACTIONS:
                    await conn.execute(self._db.q[name], {
                        "ids": [str(i) for i in redacted] if name.endswith("outbox")
                        else redacted})
        return len(redacted)
