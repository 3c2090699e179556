"""What the web console reads (calmq/sql/console.sql): jobs with filters, one job's page, the
review queue and one review, the overview's backlog, outcomes, spend and budget, and the
per-pool review caps.

Reads are bounded: a list selects no payload (no input, no output), and a page reads at most
``PREVIEW_CHARS`` of a job's input (pretty-printed by PostgreSQL; only the prefix crosses
the wire), its history and attempts up to a limit.

Every read takes ``tenant_id``: a tenant key's console sees only that tenant; None (a
platform key) sees every tenant. The overview reads the tables the Prometheus samplers and
counters are fed from (jobs, job_events, job_attempts, budget_buckets), so the page and
/metrics agree.
"""

from __future__ import annotations

import json
import math
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from calmq.data.database import Database
from calmq.data.jobs import HistoryEvent

__all__ = ["PREVIEW_CHARS", "ConsoleJob", "ConsoleReads", "JobPage", "JobQuery", "Overview",
           "QueuedReview", "Review", "search_terms"]

# The most of a job's input a page shows (and reads).
PREVIEW_CHARS = 4096
# The most history entries and attempts a job's page reads.
HISTORY_LIMIT = 1000


@dataclass(frozen=True, slots=True)
class JobQuery:
    """The jobs list's filters (None: any)."""

    tenant_id: uuid.UUID | None
    statuses: list[str] | None = None
    workflow: str | None = None
    pool: str | None = None
    priority: str | None = None  # interactive, bulk
    lane: str | None = None  # online, batch
    created_after: datetime | None = None
    created_before: datetime | None = None
    search: str | None = None  # a job id or its first characters, or a metadata value
    limit: int = 100


@dataclass(frozen=True, slots=True)
class ConsoleJob:
    id: uuid.UUID
    tenant: str
    workflow: str
    status: str
    priority: str
    lane: str
    pool: str
    step: str
    attempt: int
    created_at: datetime
    updated_at: datetime
    metadata: dict[str, Any]


@dataclass(frozen=True, slots=True)
class QueuedReview:
    """A row of the review queue (no payload)."""

    id: uuid.UUID
    tenant: str
    tenant_id: uuid.UUID
    workflow: str
    step: str
    pool: str
    review_deadline_at: datetime | None
    updated_at: datetime
    created_at: datetime
    confidence: float | None


@dataclass(frozen=True, slots=True, kw_only=True)
class Review(QueuedReview):
    """One review: the model's output, whole, and a bounded preview of the input."""

    input_preview: str | None  # at most PREVIEW_CHARS of the input, pretty-printed
    input_bytes: int | None
    input_ref: str | None
    output: dict[str, Any]


@dataclass(frozen=True, slots=True)
class JobPage:
    """One job as its console page shows it: no payload beyond a bounded input preview."""

    id: uuid.UUID
    tenant: str
    tenant_id: uuid.UUID
    workflow: str
    workflow_version: int
    status: str
    priority: str
    lane: str
    pool: str
    step: str
    attempt: int
    max_attempts: int
    created_at: datetime
    updated_at: datetime
    deadline_at: datetime | None
    review_deadline_at: datetime | None
    trace_parent: str | None
    metadata: dict[str, Any]
    input_tokens: int
    output_tokens: int
    cost_usd: Any  # numeric
    error: dict[str, Any] | None
    artifact: dict[str, Any] | None
    input_ref: str | None
    input_preview: str | None
    input_bytes: int | None


@dataclass(frozen=True, slots=True)
class Overview:
    backlog: list[dict[str, Any]]  # {pool, priority, lane, status, jobs, oldest_seconds}
    outcomes: list[dict[str, Any]]  # {bin, type, jobs}
    spend: list[dict[str, Any]]  # {hour, tokens, cost_usd, retry_cost_usd, dead_letter_cost_usd}
    budget: list[dict[str, Any]]  # {provider, model, tokens_per_minute}
    review_caps: dict[str, int]
    # Jobs waiting in queued for their pool's review cap (calmq.data.review_caps), per pool.
    review_cap_held: dict[str, int] | None = None


_HEX = frozenset("0123456789abcdef")


def search_terms(search: str | None) -> dict[str, Any]:
    """The console search's index-backed terms (console_jobs): the id range that a job id
    prefix covers (``id_low``, ``id_high``; None when ``search`` is no hexadecimal id
    prefix), and a JSON path matching a metadata value equal to ``search`` (a string, or a
    number that reads the same), served by the GIN index jobs_metadata."""
    if search is None:
        return {"id_low": None, "id_high": None, "metadata_path": None}
    digits = search.strip().lower().replace("-", "")
    low = high = None
    if 0 < len(digits) <= 32 and set(digits) <= _HEX:
        low = str(uuid.UUID(digits.ljust(32, "0")))
        high = str(uuid.UUID(digits.ljust(32, "f")))
    matches = [f"@ == {json.dumps(search)}"]
    try:
        number = float(search)
    except ValueError:
        number = None
    if number is not None and math.isfinite(number):
        matches.append(f"@ == {json.dumps(int(number) if number.is_integer() else number)}")
    return {"id_low": low, "id_high": high,
            "metadata_path": f"$.* ? ({' || '.join(matches)})"}


class ConsoleReads:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def _rows(self, name: str, params: dict[str, Any]) -> list[dict[str, Any]]:
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q[name], params)
            return list(await cur.fetchall())

    async def jobs(self, query: JobQuery) -> list[ConsoleJob]:
        params: dict[str, Any] = {f: getattr(query, f) for f in JobQuery.__dataclass_fields__}
        params.update(search_terms(query.search))
        return [ConsoleJob(**r) for r in await self._rows("console_jobs", params)]

    async def reviews(self, tenant_id: uuid.UUID | None, limit: int = 100) -> list[QueuedReview]:
        rows = await self._rows("console_reviews", {"tenant_id": tenant_id, "limit": limit})
        return [QueuedReview(**r) for r in rows]

    async def review(self, tenant_id: uuid.UUID | None, job_id: uuid.UUID) -> Review | None:
        """The job's review, if it waits for one and the caller may see it."""
        rows = await self._rows("console_review", {"tenant_id": tenant_id, "id": job_id,
                                                   "preview": PREVIEW_CHARS})
        return Review(**rows[0]) if rows else None

    async def job(self, tenant_id: uuid.UUID | None, job_id: uuid.UUID) -> JobPage | None:
        rows = await self._rows("console_job", {"tenant_id": tenant_id, "id": job_id,
                                                "preview": PREVIEW_CHARS})
        return JobPage(**rows[0]) if rows else None

    async def job_input(self, tenant_id: uuid.UUID | None, job_id: uuid.UUID) -> Any:
        """The job's whole inline input (None: by reference, or purged)."""
        rows = await self._rows("console_job_input", {"tenant_id": tenant_id, "id": job_id})
        return rows[0]["input"] if rows else None

    async def events(self, job_id: uuid.UUID, after: int = 0) -> list[HistoryEvent]:
        rows = await self._rows("console_job_events", {"id": job_id, "after": after,
                                                       "limit": HISTORY_LIMIT})
        return [HistoryEvent(**r) for r in rows]

    async def attempts(self, job_id: uuid.UUID) -> list[tuple[int, dict[str, Any]]]:
        """(round, attempt record) of every round, the current one (0) last."""
        rows = await self._rows("console_job_attempts", {"id": job_id,
                                                         "limit": HISTORY_LIMIT})
        return [(int(r["round"]), dict(r["record"])) for r in rows]

    async def overview(self, tenant_id: uuid.UUID | None) -> Overview:
        scope = {"tenant_id": tenant_id}
        caps = await self._rows("console_review_caps", {})
        return Overview(
            backlog=await self._rows("console_backlog", scope),
            outcomes=await self._rows("console_outcomes", scope),
            spend=await self._rows("console_spend", scope),
            budget=await self._rows("console_budget", {}),
            review_caps={str(r["pool"]): int(r["cap"]) for r in caps},
            review_cap_held={str(r["pool"]): int(r["held"])
                             for r in await self._rows("review_cap_held", {})},
        )

    async def set_review_cap(self, pool: str, cap: int | None, by: str) -> None:
        """Set (or with None remove) the number of pending reviews a pool's reviewers handle."""
        async with self._db.pool.connection() as conn:
            await conn.execute(self._db.q["console_set_review_cap"],
                               {"pool": pool, "cap": cap, "by": by})

    async def last_event_id(self, job_id: uuid.UUID) -> int:
        rows = await self._rows("console_last_event", {"id": job_id})
        return int(rows[0]["id"]) if rows else 0
