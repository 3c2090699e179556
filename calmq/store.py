"""The SQL store: every read and write calmq makes to PostgreSQL, by domain operation.

Queries live in calmq/sql/queries.sql. A ``Store`` owns an async connection pool; the
producers, processors and relay call it and never write SQL of their own.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import DictRow, dict_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from calmq import sql, topics
from calmq.errors import ContractError, InfrastructureError

__all__ = [
    "Finish",
    "NewJob",
    "Store",
    "Tenant",
    "hash_api_key",
    "insert_job_params",
    "new_api_key",
]

_API_KEY_PREFIX = "cq_"


def new_api_key() -> str:
    return _API_KEY_PREFIX + secrets.token_urlsafe(32)


def hash_api_key(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class Tenant:
    id: uuid.UUID
    name: str


@dataclass(frozen=True)
class NewJob:
    """A validated submission, ready to be written with its outbox event."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    workflow: str
    workflow_version: int
    priority: str
    pool: str
    step: str
    max_attempts: int
    input: dict[str, Any] | None
    input_ref: str | None
    metadata: dict[str, Any]
    callback_url: str | None
    deadline_at: datetime | None
    trace_parent: str | None
    idempotency_key: str | None = None
    request_hash: bytes | None = None


def insert_job_params(job: NewJob, event: dict[str, Any], route: str) -> dict[str, Any]:
    """Parameters of the ``insert_job`` query: job row, queued event and outbox row."""
    return {
        "id": job.id,
        "tenant_id": job.tenant_id,
        "workflow": job.workflow,
        "workflow_version": job.workflow_version,
        "priority": job.priority,
        "pool": job.pool,
        "step": job.step,
        "max_attempts": job.max_attempts,
        "input": Jsonb(job.input) if job.input is not None else None,
        "input_ref": job.input_ref,
        "metadata": Jsonb(job.metadata),
        "callback_url": job.callback_url,
        "deadline_at": job.deadline_at,
        "trace_parent": job.trace_parent,
        "event_id": event["event_id"],
        "route": route,
        "payload": Jsonb(event),
        "headers": Jsonb({"traceparent": job.trace_parent} if job.trace_parent else {}),
    }


_NO_USAGE = {"model_calls": 0, "input_tokens": 0, "output_tokens": 0, "cost_usd": 0.0}


@dataclass
class Finish:
    """How one attempt ended: the job's next status, its history event, its outbox events."""

    job_id: uuid.UUID
    worker: str
    step: str
    attempt: int
    status: str
    event_type: str
    outcome: str
    event_detail: dict[str, Any] = field(default_factory=dict)
    artifact: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    next_step: str | None = None
    reset_attempt: bool = False
    outbox: list[dict[str, Any]] = field(default_factory=list)
    # A workflow step's output to record with the move (calmq/workflows, wf_record_step_output):
    # {state, output, confidence, review_deadline_at, next_pool, next_max_attempts}.
    record: dict[str, Any] | None = None
    # The attempt's model calls: {model_calls, input_tokens, output_tokens, cost_usd}.
    usage: dict[str, Any] | None = None

    def record_params(self) -> dict[str, Any]:
        assert self.record is not None
        r = self.record
        return {"job_id": self.job_id, "worker": self.worker, "step": self.step,
                "state": r["state"], "output": Jsonb(r["output"]),
                "confidence": r.get("confidence"),
                "review_deadline_at": r.get("review_deadline_at"),
                "next_pool": r.get("next_pool"), "next_max_attempts": r.get("next_max_attempts")}

    def row(self, ord_: int) -> dict[str, Any]:
        """This outcome as one row of finish_attempts' JSON array (``ord``: its place)."""
        return {
            "job_id": str(self.job_id),
            "worker": self.worker,
            "step": self.step,
            "attempt": self.attempt,
            "status": self.status,
            "event_type": self.event_type,
            "outcome": self.outcome,
            "event_detail": self.event_detail,
            "artifact": self.artifact,
            "error": self.error,
            "next_step": self.next_step,
            "reset_attempt": self.reset_attempt,
            "outbox": [{**entry, "n": n} for n, entry in enumerate(self.outbox)],
            **(self.usage or _NO_USAGE),
            "ord": ord_,
        }


class Store:
    """Async access to calmq's tables through a connection pool."""

    def __init__(self, database_url: str, *, min_size: int = 1, max_size: int = 8) -> None:
        self._q = sql.queries()
        self.pool: AsyncConnectionPool[psycopg.AsyncConnection[DictRow]] = AsyncConnectionPool(
            database_url,
            connection_class=psycopg.AsyncConnection[DictRow],
            min_size=min_size,
            max_size=max_size,
            open=False,
            kwargs={"autocommit": True, "row_factory": dict_row},
        )

    async def open(self) -> None:
        try:
            await self.pool.open(wait=True, timeout=15)
        except psycopg.Error as exc:
            raise InfrastructureError(f"cannot connect to PostgreSQL: {exc}") from exc

    async def close(self) -> None:
        await self.pool.close()

    # -- tenants and keys -------------------------------------------------------------

    async def create_tenant(self, name: str) -> tuple[Tenant, str]:
        """A new tenant and its first API key (returned once; only its hash is stored)."""
        key = new_api_key()
        async with self.pool.connection() as conn, conn.transaction():
            try:
                cur = await conn.execute(
                    self._q["create_tenant"], {"id": uuid.uuid4(), "name": name}
                )
            except psycopg.errors.UniqueViolation as exc:
                raise ContractError(
                    f"a tenant named {name!r} exists already", code="tenant_exists", status=409
                ) from exc
            row = await cur.fetchone()
            assert row is not None
            await conn.execute(
                self._q["create_api_key"],
                {
                    "id": uuid.uuid4(),
                    "tenant_id": row["id"],
                    "key_hash": hash_api_key(key),
                    "key_prefix": key[:12],
                },
            )
        return Tenant(row["id"], row["name"]), key

    async def tenant_for_key(self, key: str) -> Tenant | None:
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._q["tenant_for_key"], {"key_hash": hash_api_key(key)})
            row = await cur.fetchone()
        return Tenant(row["id"], row["name"]) if row else None

    # -- intake -------------------------------------------------------------------------

    async def submit(
        self, job: NewJob, event: dict[str, Any], route: str
    ) -> tuple[uuid.UUID, bool]:
        """Write the job, its history and its outbox row in ONE transaction.

        Returns ``(job id, created)``; with an idempotency key seen before and the same
        request, the earlier job's id and ``False``. A different request under the same key
        raises ContractError 409.
        """
        params = insert_job_params(job, event, route)
        async with self.pool.connection() as conn:
            for _ in range(3):
                if job.idempotency_key is not None:
                    earlier = await self._earlier_job(conn, job)
                    if earlier is not None:
                        return earlier, False
                try:
                    async with conn.transaction():
                        await conn.execute(self._q["insert_job"], params)
                        if job.idempotency_key is not None:
                            await conn.execute(
                                self._q["insert_idempotency_key"],
                                {
                                    "tenant_id": job.tenant_id,
                                    "key": job.idempotency_key,
                                    "request_hash": job.request_hash,
                                    "job_id": job.id,
                                },
                            )
                    return job.id, True
                except psycopg.errors.UniqueViolation:
                    # A concurrent request with the same key won the race: answer its job.
                    continue
        raise InfrastructureError("idempotency key kept conflicting; retry the request")

    async def _earlier_job(
        self, conn: psycopg.AsyncConnection[DictRow], job: NewJob
    ) -> uuid.UUID | None:
        cur = await conn.execute(
            self._q["find_idempotency_key"],
            {"tenant_id": job.tenant_id, "key": job.idempotency_key},
        )
        row = await cur.fetchone()
        if row is None:
            return None
        if bytes(row["request_hash"]) != job.request_hash:
            raise ContractError(
                "this Idempotency-Key was used before with a different request body",
                code="idempotency_key_reused",
                status=409,
            )
        job_id: uuid.UUID = row["job_id"]
        return job_id

    async def job_view(self, tenant_id: uuid.UUID, job_id: uuid.UUID) -> dict[str, Any] | None:
        """The job and its history, or None when it does not exist for this tenant."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                self._q["job_for_tenant"], {"id": job_id, "tenant_id": tenant_id}
            )
            job = await cur.fetchone()
            if job is None:
                return None
            cur = await conn.execute(self._q["job_events"], {"id": job_id})
            job["events"] = await cur.fetchall()
        return job

    # -- processing ---------------------------------------------------------------------

    async def claim(
        self, ids: Sequence[uuid.UUID], worker: str, lease_seconds: float,
        steps: dict[uuid.UUID, str] | None = None,
    ) -> list[dict[str, Any]]:
        """Claim every claimable job of a batch in one statement (one round trip).

        With ``steps`` (job id -> the step its message asks for), a job that has moved on to
        another step is not claimed: its message is stale, and the next step's own message
        goes to that step's pool.
        """
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                self._q["claim_jobs"],
                {"ids": sorted(ids), "worker": worker, "lease_seconds": lease_seconds,
                 "steps": Jsonb({str(k): v for k, v in steps.items()}) if steps else None},
            )
            return await cur.fetchall()

    async def visible_jobs(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, tuple[str, str]]:
        """(step, status) of each job this session can see (a missing id: not visible)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(self._q["visible_jobs"], {"ids": list(ids)})
            return {r["id"]: (r["step"], r["status"]) for r in await cur.fetchall()}

    async def heartbeat(
        self, ids: Sequence[uuid.UUID], worker: str, lease_seconds: float
    ) -> set[uuid.UUID]:
        """Extend the leases this worker still holds; returns the ids it still holds."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                self._q["heartbeat"],
                {"ids": list(ids), "worker": worker, "lease_seconds": lease_seconds},
            )
            return {r["id"] for r in await cur.fetchall()}

    async def finish(self, finishes: Sequence[Finish]) -> None:
        """Record a group of finished attempts in ONE transaction (group commit)."""
        if not finishes:
            return
        # Job rows are locked in id order, like claim and heartbeat, so that concurrent
        # group commits and heartbeats cannot deadlock.
        finishes = sorted(finishes, key=lambda f: f.job_id)
        records = [f.record_params() for f in finishes if f.record is not None]
        rows = Jsonb([f.row(n) for n, f in enumerate(finishes)])
        async with self.pool.connection() as conn:
            if not records:
                # One statement is its own transaction on this autocommit connection: no
                # BEGIN and COMMIT round trips, each of which held the rows locked while it
                # waited for a busy event loop (pg_stat_activity: "idle in transaction").
                await conn.execute(self._q["finish_attempts"], {"rows": rows})
                return
            async with conn.transaction(), conn.cursor() as cur:
                # Before finish_attempts: its lease guard is still true then.
                await cur.executemany(self._q["wf_record_step_output"], records)
                await cur.execute(self._q["finish_attempts"], {"rows": rows})

    async def insert_outbox(self, entries: Sequence[dict[str, Any]]) -> None:
        """Outbox rows that belong to no job transition (e.g. an unreadable message)."""
        async with self.pool.connection() as conn, conn.transaction(), conn.cursor() as cur:
            await cur.executemany(
                self._q["insert_outbox"],
                [
                    {"id": e["id"], "route": e["route"], "aggregateid": e.get("key", e["id"]),
                     "type": e["type"], "payload": Jsonb(e["payload"]),
                     "headers": Jsonb(e.get("headers") or {})}
                    for e in entries
                ],
            )

    async def release_leases(self, ids: Sequence[uuid.UUID], worker: str) -> set[uuid.UUID]:
        """Expire now the leases ``worker`` holds on ``ids`` (it stops without finishing them)."""
        async with self.pool.connection() as conn:
            cur = await conn.execute(
                self._q["processing_release_leases"], {"ids": list(ids), "worker": worker}
            )
            return {r["id"] for r in await cur.fetchall()}

    async def reap_expired_leases(self, limit: int = 500) -> list[dict[str, Any]]:
        """Requeue jobs whose lease expired, re-emitting job.requested in the same transaction."""
        from calmq import events

        async with self.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._q["reap_expired_leases"], {"limit": limit})
            rows = await cur.fetchall()
            if rows:
                async with conn.cursor() as out:
                    await out.executemany(
                        self._q["insert_outbox"],
                        [
                            {
                                "id": (ev := events.requested(r))["event_id"],
                                "route": topics.work_route(r["pool"], r["priority"]),
                                "aggregateid": str(r["id"]),
                                "type": "job.requested",
                                "payload": Jsonb(ev),
                                "headers": Jsonb(
                                    {"traceparent": r["trace_parent"]} if r["trace_parent"] else {}
                                ),
                            }
                            for r in rows
                        ],
                    )
        return rows

    async def cancel(self, tenant_id: uuid.UUID, job_id: uuid.UUID) -> bool:
        """Cancel a job that is not terminal; its result event goes out through the outbox."""
        from calmq import events

        async with self.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._q["cancel_job"], {"id": job_id, "tenant_id": tenant_id})
            row = await cur.fetchone()
            if row is None:
                return False
            ev = events.result(row, "cancelled")
            await conn.execute(
                self._q["insert_outbox"],
                {"id": ev["event_id"], "route": topics.RESULTS_ROUTE, "aggregateid": str(job_id),
                 "type": "job.result", "payload": Jsonb(ev),
                 # the request's trace goes on with every event of the job
                 "headers": Jsonb({"traceparent": row["trace_parent"]}
                                  if row.get("trace_parent") else {})},
            )
        return True
