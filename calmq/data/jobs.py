"""Jobs: the typed job records and every query that creates, claims, moves or reads a job.

``NewJob`` is a submission about to be written, ``Job`` a job as a worker holds it after a
claim, ``JobSnapshot`` and ``JobDetail`` (with its ``HistoryEvent`` list) a job as its
tenant reads it. ``Jobs(db)`` runs the queries of calmq/sql/jobs.sql on the pool;
``insert_job`` and ``insert_job_sync`` write a new job on a connection the caller owns (the
client library enqueues inside the caller's transaction) and import nothing of the server.

Adding a column to jobs touches the migration, the Avro schema when events carry it,
calmq/sql/jobs.sql (the insert, the ``job_row`` fragment every statement that returns a Job
uses, and the API's reads) and the records here; for a field clients send, the API's request
model (producers/models.py) too, whose fields reach NewJob by name (producers.intake.prepare).
Nothing else: the insert parameters are NewJob's fields, and ``job.requested`` is filled
from the record by the Avro schema's field names (calmq.events).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from decimal import Decimal
from functools import partial
from operator import attrgetter
from typing import Any

import psycopg
from psycopg.rows import DictRow
from psycopg.types.json import Jsonb

from calmq import events, sql, topics
from calmq.data.database import Database
from calmq.data.outbox import OutboxEntry, entry
from calmq.data.outbox import insert as insert_outbox
from calmq.errors import ContractError, InfrastructureError
from calmq.jobs import EventType, Status

__all__ = [
    "HistoryEvent",
    "Idempotency",
    "Job",
    "JobDetail",
    "JobFilter",
    "JobSearch",
    "JobSnapshot",
    "Jobs",
    "NewJob",
    "TenantJob",
    "insert_job",
    "insert_job_sync",
    "insert_jobs",
    "insert_keyed",
    "keyed_job",
]


@dataclass(slots=True, kw_only=True)
class Job:
    """A job as a worker holds it: the ``job_row`` fragment's columns (calmq/sql/jobs.sql)
    and ``old_status``, which every statement that returns jobs reads.

    ``old_status`` is the status the claim found (``running`` means its lease had expired
    and the job was taken over from a dead worker). ``lease_version`` is the claim's fencing
    token: every write of the attempt carries it, and the database takes the write only
    while the job is still at that version (calmq/sql/migrations/0011_attempt_fencing.sql).
    """

    id: uuid.UUID
    tenant_id: uuid.UUID
    workflow: str
    workflow_version: int
    priority: str
    pool: str
    step: str
    attempt: int
    max_attempts: int
    input: dict[str, Any] | None
    input_ref: str | None
    metadata: dict[str, Any]
    deadline_at: datetime | None
    trace_parent: str | None
    created_at: datetime
    old_status: str
    lease_version: int = 0  # 0: never claimed
    # online, or batch (the providers' batch APIs: calmq.processors.batcher)
    lane: str = "online"
    # A key inside the tenant (a customer): its workflow's concurrency and rate limits
    # count by it (calmq.data.concurrency, calmq.calls.key_rates).
    concurrency_key: str | None = None

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Job:
        """The record of one row of a statement that returns jobs (claim, reap, sweep, the
        hold releases, the batch lane's pending jobs).

        They return exactly these columns (the ``job_row`` fragment and ``old_status``;
        tests/integration/test_job_row.py runs each), so this is a plain keyword call: no
        per-field work on the hot path.
        """
        return cls(**row)


@dataclass(frozen=True, slots=True, kw_only=True)
class NewJob:
    """A validated submission: exactly the columns ``insert_job`` writes, by name."""

    id: uuid.UUID
    tenant_id: uuid.UUID
    workflow: str
    workflow_version: int
    priority: str
    pool: str
    step: str
    max_attempts: int
    input: dict[str, Any] | None = None
    input_ref: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    callback_url: str | None = None
    deadline_at: datetime | None = None
    trace_parent: str | None = None
    lane: str = "online"
    # A key inside the tenant (a customer) its workflow's concurrency_limit counts by.
    concurrency_key: str | None = None

    @property
    def attempt(self) -> int:
        """A new job has made no attempt yet (``job.requested`` carries it)."""
        return 0

    @property
    def created_at(self) -> None:
        """Not yet: ``insert_job`` puts the commit time into its ``job.requested``."""
        return None


_JOB_FIELDS = tuple(f.name for f in fields(Job))
_NEW_JOB_FIELDS = tuple(f.name for f in fields(NewJob))
_new_job_values = attrgetter(*_NEW_JOB_FIELDS)
# Columns of type jsonb: psycopg needs them wrapped (decided once, from the annotations).
_NEW_JOB_JSON = tuple(f.name for f in fields(NewJob) if str(f.type).startswith("dict"))


@dataclass(frozen=True, slots=True)
class HistoryEvent:
    """One entry of a job's history (``id``: its place, the SSE event id)."""

    id: int
    type: str
    at: datetime
    attempt: int
    detail: dict[str, Any]


@dataclass(frozen=True, slots=True, kw_only=True)
class JobSnapshot:
    """A job as a page of GET /v1/jobs lists it: the ``list_jobs`` columns."""

    id: uuid.UUID
    workflow: str
    status: str
    attempt: int
    step: str
    artifact: dict[str, Any] | None
    error: dict[str, Any] | None
    created_at: datetime
    updated_at: datetime
    # The submitter's own keys, returned as given so a caller can correlate a job with its
    # own records (a row read by a query without the column keeps the empty default).
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobDetail(JobSnapshot):
    """A job as GET /v1/jobs/{id} answers it: the snapshot, its usage and its history."""

    input_tokens: int
    output_tokens: int
    cost_usd: Decimal  # numeric in PostgreSQL
    events: list[HistoryEvent]
    # Why a waiting job is not being run (a spend cap: calmq.spending); None: nothing holds it.
    waiting_reason: str | None = None
    # The job whose step started this one (calmq.data.children); None: submitted.
    parent_id: uuid.UUID | None = None
    # The job this one reruns from a step (calmq.reruns); None: not a rerun.
    rerun_of: uuid.UUID | None = None
    # Of input_tokens: read from and written to the provider's prompt cache, and what the
    # cache saved (calmq.calls.caching); a query without the columns keeps 0.
    cached_input_tokens: int = 0
    cache_write_tokens: int = 0
    cache_saved_usd: Decimal = Decimal(0)


@dataclass(frozen=True, slots=True)
class JobFilter:
    """Which of a tenant's jobs a page lists (None: any), and where the page starts: after
    the (created_at, id) of the previous page's last job, newest first."""

    tenant_id: uuid.UUID
    limit: int
    statuses: list[str] | None = None
    workflow: str | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None
    cursor_at: datetime | None = None
    cursor_id: uuid.UUID | None = None
    # Pairs the job's metadata must all hold (jsonb containment, index jobs_metadata).
    metadata: dict[str, Any] | None = None


_FILTER_FIELDS = tuple(f.name for f in fields(JobFilter))


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantJob(JobSnapshot):
    """A job as an operator lists it (every tenant's): the snapshot and whose it is."""

    tenant_id: uuid.UUID
    tenant: str


@dataclass(frozen=True, slots=True)
class JobSearch:
    """Which jobs of any tenant an operator lists (None: any): JobFilter's filters with the
    tenant's name instead of its id, newest first after the (created_at, id) cursor."""

    limit: int
    tenant: str | None = None
    statuses: list[str] | None = None
    workflow: str | None = None
    created_after: datetime | None = None
    created_before: datetime | None = None
    cursor_at: datetime | None = None
    cursor_id: uuid.UUID | None = None
    metadata: dict[str, Any] | None = None


_SEARCH_FIELDS = tuple(f.name for f in fields(JobSearch))


def _filter_params(which: JobFilter | JobSearch, names: tuple[str, ...]) -> dict[str, Any]:
    params = {name: getattr(which, name) for name in names}
    if params["metadata"] is not None:
        params["metadata"] = Jsonb(params["metadata"])
    return params


@dataclass(frozen=True, slots=True)
class Idempotency:
    """An ``Idempotency-Key`` and the hash of the request body it was first sent with."""

    key: str
    request_hash: bytes


def _row(job: NewJob) -> dict[str, Any]:
    """Every NewJob field by name, its event and outbox row, as plain values: ``insert_job``'s
    parameters once its JSON columns are wrapped, one element of ``insert_jobs``' array as
    they are."""
    params = dict(zip(_NEW_JOB_FIELDS, _new_job_values(job), strict=True))
    out = requested(job)
    params.update(event_id=out.id, route=out.route, payload=out.payload, headers=out.headers)
    return params


def _insert_params(job: NewJob) -> dict[str, Any]:
    """``insert_job``'s parameters: ``_row`` with its JSON values wrapped for psycopg."""
    params = _row(job)
    for name in (*_NEW_JOB_JSON, "payload", "headers"):
        if params[name] is not None:
            params[name] = Jsonb(params[name])
    return params


def requested(job: NewJob | Job | Mapping[str, Any]) -> OutboxEntry:
    """The job.requested that sends a job (new, reaped, swept, released, redriven, or moved
    on by a review) to its topic: its pool's priority topic, or the batch lane's. ``job``:
    a record, or a jobs row as a statement returned it. Every re-publish goes through here,
    so none can drop the lane (a released batch-lane job once went to the online topic, and
    a redriven or approved one did until issue 27)."""
    if isinstance(job, Mapping):
        pool, priority, lane = job["pool"], job["priority"], job.get("lane") or "online"
        job_id, trace_parent = job["id"], job.get("trace_parent")
    else:
        pool, priority, lane = job.pool, job.priority, job.lane
        job_id, trace_parent = job.id, job.trace_parent
    # created_at: for a new job the database's commit-side clock replaces it (insert_job).
    return entry(topics.work_route(pool, priority, lane), "job.requested",
                 events.requested(job), key=job_id, trace_parent=trace_parent)


async def republish(conn: Any, insert_outbox: str, jobs: Sequence[Job]) -> None:
    """Write each job's job.requested into the outbox, in the caller's transaction."""
    if jobs:
        async with conn.cursor() as out:
            await out.executemany(insert_outbox, [requested(j).params() for j in jobs])


def _json_value(value: Any) -> Any:
    """What ``insert_jobs``' array holds for a value json cannot encode itself: ids as text,
    times in ISO 8601 (jsonb_to_recordset reads both back as their column types)."""
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime):
        return value.isoformat()
    raise TypeError(f"{type(value).__name__} is not a column value of insert_jobs")


# insert_jobs' array (``_row`` of each job) is dumped by json's C encoder in one call; it
# calls _json_value only for the ids and times, instead of a Python pass over every field of
# every row first.
_dump_rows = partial(json.dumps, default=_json_value, separators=(",", ":"))


async def insert_job(conn: psycopg.AsyncConnection[Any], job: NewJob) -> None:
    """Write the job, its ``queued`` event and its outbox row on ``conn`` (one statement).

    Nothing is committed here: on the caller's connection the job commits or rolls back
    with the caller's own transaction.
    """
    await conn.execute(sql.queries()["insert_job"], _insert_params(job))


def insert_job_sync(conn: psycopg.Connection[Any], job: NewJob) -> None:
    """``insert_job`` on a synchronous psycopg connection."""
    conn.execute(sql.queries()["insert_job"], _insert_params(job))


async def insert_jobs(conn: psycopg.AsyncConnection[Any], jobs: Sequence[NewJob]) -> None:
    """Write many new jobs in ONE statement (the API's group commit)."""
    if len(jobs) == 1:
        await insert_job(conn, jobs[0])
        return
    await conn.execute(sql.queries()["insert_jobs"],
                       {"jobs": Jsonb([_row(j) for j in jobs], dumps=_dump_rows)})


class Jobs:
    """The job queries that run on the pool: submit, read, claim, lease, reap, cancel."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._q = db.q

    # -- intake -------------------------------------------------------------------------

    async def submit(self, job: NewJob, idempotency: Idempotency) -> tuple[uuid.UUID, bool]:
        """Write the job and its idempotency key in ONE transaction.

        Returns ``(job id, created)``; with a key seen before and the same request, the
        earlier job's id and ``False``. A different request under the same key raises
        ContractError 409.
        """
        params = _insert_params(job)
        async with self._db.pool.connection() as conn:

            async def insert() -> bool:
                await conn.execute(self._q["insert_job"], params)
                return True

            made = await insert_keyed(conn, self._q, job.tenant_id, job.id, idempotency,
                                      insert=insert)
        assert made is not None  # the insert always writes
        return made

    async def submit_many(self, tenant_id: uuid.UUID,
                          items: Sequence[tuple[NewJob, Idempotency | None]]
                          ) -> list[tuple[uuid.UUID, bool] | BaseException]:
        """Write a bulk submit's jobs, their outbox rows and their keys in ONE transaction.

        Per item, in order: ``(job id, created)`` as ``submit`` answers it (a key seen before,
        or earlier in ``items``, with the same request hash: that job and ``False``), or the
        exception that refuses it alone: ContractError 409 for a key reused with another
        request, or the driver's error for a row PostgreSQL would not store (the caller maps
        it, producers.intake.refusal). When a row fails, the others are written with each
        row in a savepoint of the same transaction, so a bad row never refuses the rest.
        """
        async with self._db.pool.connection() as conn:
            for _ in range(3):
                try:
                    async with conn.transaction():
                        return await self._write_many(conn, tenant_id, items)
                except psycopg.errors.UniqueViolation:
                    # A concurrent request took one of the keys: read them all again.
                    continue
        raise InfrastructureError("idempotency keys kept conflicting; retry the request")

    async def _write_many(self, conn: psycopg.AsyncConnection[DictRow], tenant_id: uuid.UUID,
                          items: Sequence[tuple[NewJob, Idempotency | None]]
                          ) -> list[tuple[uuid.UUID, bool] | BaseException]:
        keys = sorted({idem.key for _, idem in items if idem is not None})
        known: dict[str, tuple[bytes, uuid.UUID]] = {}
        if keys:
            cur = await conn.execute(self._q["find_idempotency_keys"],
                                     {"tenant_id": tenant_id, "keys": keys})
            known = {r["key"]: (bytes(r["request_hash"]), r["job_id"])
                     for r in await cur.fetchall()}
        answers: list[tuple[uuid.UUID, bool] | BaseException] = []
        new: list[tuple[int, NewJob, Idempotency | None]] = []
        for index, (job, idem) in enumerate(items):
            if idem is not None and idem.key in known:
                request_hash, earlier = known[idem.key]
                answers.append((earlier, False) if request_hash == idem.request_hash
                               else ContractError(
                                   "this idempotency key was used before with a different "
                                   "request body", code="idempotency_key_reused", status=409))
                continue
            if idem is not None:  # a later item with the same key is its duplicate
                known[idem.key] = (idem.request_hash, job.id)
            answers.append((job.id, True))
            new.append((index, job, idem))
        try:
            async with conn.transaction():  # a savepoint: the fallback below needs one
                await self._insert_many(conn, tenant_id, [(j, i) for _, j, i in new])
        except (UnicodeError, psycopg.DataError):
            for index, job, idem in new:
                try:
                    async with conn.transaction():
                        await self._insert_many(conn, tenant_id, [(job, idem)])
                except (UnicodeError, psycopg.DataError) as exc:
                    answers[index] = exc
            failed = {job.id: answers[index] for index, job, _ in new
                      if isinstance(answers[index], BaseException)}
            # A later item under a failed item's key named a job that was not written.
            answers = [failed.get(a[0], a) if isinstance(a, tuple) else a for a in answers]
        return answers

    async def _insert_many(self, conn: psycopg.AsyncConnection[DictRow], tenant_id: uuid.UUID,
                           rows: Sequence[tuple[NewJob, Idempotency | None]]) -> None:
        if not rows:
            return
        await insert_jobs(conn, [job for job, _ in rows])
        keyed = [(idem, job.id) for job, idem in rows if idem is not None]
        if keyed:
            await conn.execute(self._q["insert_idempotency_keys"], {
                "tenant_id": tenant_id, "keys": [i.key for i, _ in keyed],
                "hashes": [i.request_hash for i, _ in keyed],
                "job_ids": [j for _, j in keyed]})

    # -- reading ------------------------------------------------------------------------

    async def view(self, tenant_id: uuid.UUID, job_id: uuid.UUID) -> JobDetail | None:
        """The job and its history, or None when it does not exist for this tenant."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["job_for_tenant"],
                                     {"id": job_id, "tenant_id": tenant_id})
            row = await cur.fetchone()
            if row is None:
                return None
            cur = await conn.execute(self._q["job_events"], {"id": job_id})
            history = [HistoryEvent(**e) for e in await cur.fetchall()]
        return JobDetail(**row, events=history)

    async def page(self, which: JobFilter) -> list[JobSnapshot]:
        """One page of a tenant's jobs, newest first."""
        params = _filter_params(which, _FILTER_FIELDS)
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(
                self._q["list_jobs" if which.metadata is None else "list_jobs_by_metadata"],
                params)
            return [JobSnapshot(**r) for r in await cur.fetchall()]

    async def search(self, which: JobSearch) -> list[TenantJob]:
        """One page of every tenant's jobs (operators), newest first."""
        params = _filter_params(which, _SEARCH_FIELDS)
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["ops_list_jobs"], params)
            return [TenantJob(**r) for r in await cur.fetchall()]

    async def count(self, which: JobSearch) -> int:
        """How many jobs ``search`` would page through from ``which``'s cursor on."""
        params = _filter_params(which, _SEARCH_FIELDS)
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["ops_count_jobs"], params)
            row = await cur.fetchone()
        return int(row["n"]) if row is not None else 0

    async def tenant_of(self, job_id: uuid.UUID) -> uuid.UUID | None:
        """The id of the job's tenant; None for an unknown job."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["job_tenant"], {"id": job_id})
            row = await cur.fetchone()
        return None if row is None else uuid.UUID(str(row["tenant_id"]))

    async def status_and_events(self, tenant_id: uuid.UUID, job_id: uuid.UUID,
                                after: int) -> tuple[str | None, list[HistoryEvent]]:
        """The job's status and its history after event ``after`` (None: no such job).

        Status first, then events, on one connection: a terminal status implies its event
        is visible.
        """
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["job_status"],
                                     {"id": job_id, "tenant_id": tenant_id})
            row = await cur.fetchone()
            if row is None:
                return None, []
            cur = await conn.execute(self._q["job_events_after"],
                                     {"id": job_id, "after": after})
            return str(row["status"]), [HistoryEvent(**e) for e in await cur.fetchall()]

    async def ping(self, wait: float = 2.0) -> None:
        """Raise unless PostgreSQL answers (readiness), waiting at most ``wait`` seconds for a
        connection: a probe must answer before the prober's own timeout, not the pool's."""
        async with self._db.pool.connection(timeout=wait) as conn:
            await conn.execute("SELECT 1")

    # -- processing ---------------------------------------------------------------------

    async def claim(
        self, ids: Sequence[uuid.UUID], worker: str, lease_seconds: float,
        steps: dict[uuid.UUID, str] | None = None,
    ) -> list[Job]:
        """Claim every claimable job of a batch in one statement (one round trip).

        With ``steps`` (job id -> the step its message asks for), a job that has moved on to
        another step is not claimed: its message is stale, and the next step's own message
        goes to that step's pool.
        """
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(
                self._q["claim_jobs"],
                {"ids": sorted(ids), "worker": worker, "lease_seconds": lease_seconds,
                 "steps": Jsonb({str(k): v for k, v in steps.items()}) if steps else None},
            )
            return [Job.from_row(r) for r in await cur.fetchall()]

    async def visible(self, ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, tuple[str, str]]:
        """(step, status) of each job this session can see (a missing id: not visible)."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["visible_jobs"], {"ids": list(ids)})
            return {r["id"]: (r["step"], r["status"]) for r in await cur.fetchall()}

    async def heartbeat(
        self, leases: Mapping[uuid.UUID, int], worker: str, lease_seconds: float
    ) -> set[uuid.UUID]:
        """Extend the leases this worker still holds (``leases``: job id -> the attempt's
        lease_version); returns the ids whose lease is still that attempt's."""
        ids = list(leases)
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(
                self._q["heartbeat"],
                {"ids": ids, "versions": [leases[i] for i in ids], "worker": worker,
                 "lease_seconds": lease_seconds})
            return {r["id"] for r in await cur.fetchall()}

    async def release_leases(self, leases: Mapping[uuid.UUID, int],
                             worker: str) -> set[uuid.UUID]:
        """Expire now the leases ``worker``'s attempts hold (``leases``: job id -> the
        attempt's lease_version; it stops without finishing them)."""
        ids = list(leases)
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["release_leases"],
                                     {"ids": ids, "versions": [leases[i] for i in ids],
                                      "worker": worker})
            return {r["id"] for r in await cur.fetchall()}

    async def reap_expired_leases(self, limit: int = 500) -> list[Job]:
        """Requeue jobs whose lease expired, re-emitting job.requested in the same transaction."""
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._q["reap_expired_leases"], {"limit": limit})
            jobs = [Job.from_row(r) for r in await cur.fetchall()]
            await republish(conn, self._q["insert_outbox"], jobs)
        return jobs

    async def dead_letter_poisoned(self, error: dict[str, Any], limit: int = 500) -> list[Job]:
        """Dead-letter jobs whose lease expired on an attempt that used up their budget
        (``poison_expired_leases``): they killed their worker on every attempt. Their
        ``job.result`` and ``job.dead_lettered`` go out in the same transaction."""
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._q["poison_expired_leases"],
                                     {"limit": limit, "error": Jsonb(error),
                                      "keep_errors": self._db.keep_errors})
            rows = await cur.fetchall()
            if rows:
                async with conn.cursor() as out:
                    await out.executemany(self._q["insert_outbox"], [
                        e.params() for r in rows for e in (
                            entry(topics.RESULTS_ROUTE, "job.result",
                                  events.result(r, Status.DEAD_LETTER, error=error),
                                  key=r["id"], trace_parent=r["trace_parent"]),
                            entry(topics.DLQ_ROUTE, "job.dead_lettered",
                                  events.dead_lettered(r, errors=r["errors"],
                                                       last_event=EventType.DEAD_LETTERED),
                                  key=r["id"], trace_parent=r["trace_parent"]))])
        return [Job.from_row({name: r[name] for name in _JOB_FIELDS}) for r in rows]

    async def sweep_stranded(self, grace_seconds: float, longest_tier_seconds: float,
                             limit: int = 500) -> list[Job]:
        """Re-publish waiting jobs that no message carries any more (``sweep_stranded_jobs``).

        One pass at a time in the fleet (an advisory lock held by this transaction): a
        concurrent pass returns ``[]`` at once. A job that still had its message gets a
        second one; that is harmless, because claims are status-guarded: the first claim
        wins and the other delivery finds the job running or done and is acknowledged.
        """
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._q["sweep_lock"])
            row = await cur.fetchone()
            if row is None or not row["held"]:
                return []
            cur = await conn.execute(self._q["sweep_stranded_jobs"], {
                "grace_seconds": grace_seconds, "longest_tier_seconds": longest_tier_seconds,
                "limit": limit})
            jobs = [Job.from_row(r) for r in await cur.fetchall()]
            await republish(conn, self._q["insert_outbox"], jobs)
        return jobs

    async def cancel(self, tenant_id: uuid.UUID, job_id: uuid.UUID, by: str | None = None
                     ) -> bool:
        """Cancel a job that is not terminal; its result event goes out through the outbox.
        ``by``: who cancelled, recorded in the ``cancelled`` event's detail."""
        async with self._db.pool.connection() as conn, conn.transaction():
            cur = await conn.execute(self._q["cancel_job"],
                                     {"id": job_id, "tenant_id": tenant_id, "by": by})
            row = await cur.fetchone()
            if row is None:
                return False
            result = entry(topics.RESULTS_ROUTE, "job.result",
                           events.result(row, Status.CANCELLED), key=job_id,
                           trace_parent=row["trace_parent"])
            await conn.execute(self._q["insert_outbox"], result.params())
            # Its children (and theirs) the cancel took along: each one's result too.
            cur = await conn.execute(self._q["children_cancelled_with"], {"id": job_id})
            children = [entry(topics.RESULTS_ROUTE, "job.result",
                              events.result(child, Status.CANCELLED), key=child["id"],
                              trace_parent=child["trace_parent"])
                        for child in await cur.fetchall()]
            if children:
                await insert_outbox(conn, children)
        return True


async def keyed_job(conn: psycopg.AsyncConnection[DictRow], queries: Mapping[str, str],
                    tenant_id: uuid.UUID, idempotency: Idempotency) -> uuid.UUID | None:
    """The job an earlier request under the tenant's Idempotency-Key made (a submit's or a
    rerun's: one key space per tenant), None for a new key; ContractError 409
    ``idempotency_key_reused`` when the key came with another request."""
    cur = await conn.execute(queries["find_idempotency_key"],
                             {"tenant_id": tenant_id, "key": idempotency.key})
    row = await cur.fetchone()
    if row is None:
        return None
    if bytes(row["request_hash"]) != idempotency.request_hash:
        raise ContractError(
            "this Idempotency-Key was used before with a different request body",
            code="idempotency_key_reused", status=409)
    job_id: uuid.UUID = row["job_id"]
    return job_id


async def insert_keyed(conn: psycopg.AsyncConnection[DictRow], queries: Mapping[str, str],
                       tenant_id: uuid.UUID, job_id: uuid.UUID, idempotency: Idempotency,
                       *, insert: Callable[[], Awaitable[bool]]
                       ) -> tuple[uuid.UUID, bool] | None:
    """``insert`` (False: it wrote nothing) and the tenant's Idempotency-Key for ``job_id``
    in ONE transaction (a submit's and a rerun's alike): ``(job_id, True)``; the earlier
    job's id and False for a key seen before with the same request; None when ``insert``
    wrote nothing. A concurrent request under the same key that wins the race is answered
    with its job."""
    for _ in range(3):
        earlier = await keyed_job(conn, queries, tenant_id, idempotency)
        if earlier is not None:
            return earlier, False
        try:
            async with conn.transaction():
                if not await insert():
                    return None
                await conn.execute(queries["insert_idempotency_key"], {
                    "tenant_id": tenant_id, "key": idempotency.key,
                    "request_hash": idempotency.request_hash, "job_id": job_id})
            return job_id, True
        except psycopg.errors.UniqueViolation:
            continue  # the key's row came first from the other request: answer its job
    raise InfrastructureError("idempotency key kept conflicting; retry the request")
