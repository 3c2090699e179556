"""What the console's views read and do, through the same code the JSON API uses.

The one module between the views and the data layer: lists and pages read through
calmq.data.console (bounded: no payloads in lists, previews of at most a few KiB), actions go
through the same operations as their /v1 routes (calmq.reviews, calmq.deadletters, the jobs
store) with the signed-in key's audit identity as who did it. Views import this module, never
the data layer (a contract of `make lint`).
"""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from calmq.calls.pricing import price_for, unpriced_models
from calmq.data.children import ChildrenSummary, ChildView
from calmq.data.console import ConsoleJob, ConsoleReads, JobPage, JobQuery, QueuedReview, Review
from calmq.data.deadletters import DeadLetter, DeadLetterGroup
from calmq.data.jobs import HistoryEvent
from calmq.data.observability import SlotState, replication_slots
from calmq.data.operations import Operations
from calmq.data.providers import ProviderLedger
from calmq.deadletters import DeadLetterFilter, DeadLetters, RedriveOutcome
from calmq.errors import ContractError, NotFound
from calmq.lag import GroupLag
from calmq.objects import iter_chunks, stat_object
from calmq.producers.console.lag import FleetLag
from calmq.producers.console.shaping import (
    JOB_COSTS_WINDOW_SECONDS,
    PREVIEW_BYTES,
    Preview,
    job_costs_view,
    overview_view,
    preview,
    providers_view,
)
from calmq.producers.context import GATES, OBJECTS, SETTINGS, STORE, WORKFLOWS
from calmq.producers.problems import hide_hosts
from calmq.producers.uploads import read_object, tenant_owns
from calmq.producers.views import public_error
from calmq.reruns import Reruns
from calmq.reviews import Decision, ReviewDesk
from calmq.workflows import Workflow

__all__ = ["CONSUMER_LAG", "ConsoleData", "ConsoleJob", "DeadLetter", "DeadLetterGroup", "Download",
           "HistoryEvent", "JobPage", "JobQuery", "QueuedReview", "RedriveOutcome", "Review"]

# The overview's consumer-lag reader: one per application, so page views share its answer.
CONSUMER_LAG = web.AppKey("console_consumer_lag", FleetLag)


@dataclass(frozen=True, slots=True)
class Download:
    """A job's input or artifact to send: its type, its size and its bytes in chunks."""

    content_type: str
    size: int
    chunks: AsyncIterator[bytes]


async def _once(body: bytes) -> AsyncIterator[bytes]:
    yield body


@dataclass(frozen=True, slots=True)
class Family:
    """A job's place in a tree of child jobs (calmq.data.children): its parent, its
    children counted by status and its joins, and the first of its children."""

    summary: ChildrenSummary
    children: list[ChildView]


@dataclass(frozen=True, slots=True)
class JobView:
    """A job's page: the row, its history, its attempts and previews."""

    job: JobPage
    events: list[HistoryEvent]
    attempts: list[tuple[int, dict[str, Any]]]
    last_event: int
    input_preview: Preview | None  # of an input by reference (its tenant's object)
    artifact_preview: Preview | None


class ConsoleData:
    def __init__(self, app: web.Application) -> None:
        self.app = app
        self.store = app[STORE]
        self.reads = ConsoleReads(self.store)
        self.workflows: dict[str, Workflow] = app[WORKFLOWS]
        self.objects = app[OBJECTS]
        self.settings = app[SETTINGS]

    @classmethod
    def of(cls, request: web.Request) -> ConsoleData:
        return cls(request.app)

    def workflow(self, name: str) -> Workflow | None:
        return self.workflows.get(name)

    # -- overview ----------------------------------------------------------------------------

    async def overview(self, scope: uuid.UUID | None) -> dict[str, Any]:
        data = await self.reads.overview(scope)
        states = await ProviderLedger(self.store).states()
        now = datetime.now(UTC)
        view = overview_view(backlog=data.backlog, outcomes=data.outcomes, spend=data.spend,
                             budget=data.budget, review_caps=data.review_caps,
                             review_cap_held=data.review_cap_held or {}, now=now)
        view["job_costs"] = job_costs_view(
            await Operations(self.store).costs(JOB_COSTS_WINDOW_SECONDS, tenant_id=scope))
        in_use = [(str(b["provider"]), str(b["model"])) for b in data.budget]
        view.update(providers_view(states, self.unpriced([*in_use, *(
            (s.provider, s.model) for s in states)]), platform=scope is None, now=now))
        return view

    def unpriced(self, in_use: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """(provider kind, model) of the models with no price: this process's configured
        chat and embeddings models and ``in_use`` (the fleet's budgets and provider states)
        that neither CALMQ_PRICES nor the price table knows, and any this process called
        without a price (calmq.calls.pricing.unpriced_models)."""
        s = self.settings
        pairs = [(s.provider, s.model), *in_use]
        endpoint = s.embeddings_endpoint
        if endpoint is not None:
            pairs.append((endpoint[0], endpoint[3]))
        found = set(unpriced_models())
        for provider, model in pairs:
            if price_for(s.prices, provider, model, table=s.prices_table) is None:
                found.add((provider.split(":", 1)[0], model))
        return sorted(found)

    async def slots(self) -> list[SlotState]:
        return await replication_slots(self.store)

    async def consumer_lag(self) -> list[GroupLag] | None:
        return await self.app[CONSUMER_LAG].read(self.settings)

    async def set_review_cap(self, pool: str, cap: int | None, by: str) -> None:
        await self.reads.set_review_cap(pool, cap, by)

    # -- jobs --------------------------------------------------------------------------------

    async def jobs(self, query: JobQuery) -> list[ConsoleJob]:
        return await self.reads.jobs(query)

    async def job(self, scope: uuid.UUID | None, job_id: uuid.UUID) -> JobPage:
        """The job's row (bounded), or NotFound (unknown, or another tenant's). A tenant
        (``scope``) reads its error as the API shows it, with no internal host name; a
        platform key reads it whole."""
        job = await self.reads.job(scope, job_id)
        if job is None:
            raise NotFound("no such job")
        return job if scope is None else replace(job, error=public_error(job.error))

    async def _events(self, scope: uuid.UUID | None, job_id: uuid.UUID, after: int = 0
                      ) -> list[HistoryEvent]:
        events = await self.reads.events(job_id, after)
        if scope is None:
            return events
        return [replace(e, detail=public_error(e.detail)) for e in events]

    async def family(self, job: JobPage, first: int = 50) -> Family:
        """The job's parent, children (counts by status, the first ``first`` in input
        order) and joins, for its page; read in the job's own tenant."""
        summary = await self.store.children.summary(job.tenant_id, job.id)
        children = (await self.store.children.page(job.tenant_id, job.id, limit=first)
                    if summary.total else [])
        return Family(summary, children)

    async def job_view(self, scope: uuid.UUID | None, job_id: uuid.UUID) -> JobView:
        job = await self.job(scope, job_id)
        events = await self._events(scope, job_id)
        input_preview = None
        if job.input_preview is None and job.input_ref and self.owns(job, job.input_ref):
            input_preview = await self.preview(job.input_ref, None)
        artifact = job.artifact
        return JobView(
            job=job, events=events, attempts=[
                (n, attempt if scope is None else _public_attempt(attempt))
                for n, attempt in await self.reads.attempts(job_id)],
            last_event=events[-1].id if events else 0, input_preview=input_preview,
            artifact_preview=await self.preview(str(artifact["uri"]),
                                                artifact.get("content_type"))
            if artifact else None)

    async def events_after(self, scope: uuid.UUID | None, job_id: uuid.UUID, after: int
                           ) -> tuple[str, list[HistoryEvent]]:
        """The job's status and its history after event ``after``: status first, so a
        terminal status implies its event is among them."""
        job = await self.job(scope, job_id)
        return job.status, await self._events(scope, job_id, after)

    def owns(self, job: JobPage | Review, uri: str) -> bool:
        """Whether ``uri`` is an object of the job's tenant (the only ones a page reads)."""
        return tenant_owns(self.settings.object_store_url, job.tenant_id, uri)

    async def preview(self, uri: str, content_type: str | None) -> Preview:
        """The object's first PREVIEW_BYTES and its size: never the whole object."""
        try:
            info = await stat_object(self.objects, uri)
            chunks = iter_chunks(self.objects, uri, PREVIEW_BYTES + 1)
            try:
                head = await anext(aiter(chunks), b"")
            finally:
                await chunks.aclose()  # type: ignore[attr-defined]
        except (ContractError, OSError):
            return preview(None, None, content_type)
        return preview(head[:PREVIEW_BYTES + 1], info.size, content_type or info.content_type)

    @contextlib.contextmanager
    def read_gate(self, tenant_id: uuid.UUID) -> Iterator[None]:
        """One of the tenant's expensive reads (api_reads_per_tenant, shared with /v1 in
        this process) while the block runs; 429 too_many_reads at once past it."""
        with self.app[GATES].hold("read", tenant_id):
            yield

    async def input_download(self, job: JobPage) -> Download:
        """The job's whole input, to download: the inline JSON, or its tenant's object as a
        stream of chunks (never read whole: an input by reference may be hundreds of MiB)."""
        if job.input_preview is not None:
            body = json.dumps(await self.reads.job_input(job.tenant_id, job.id)).encode()
            return Download("application/json", len(body), _once(body))
        if not job.input_ref or not self.owns(job, job.input_ref):
            raise NotFound("the job has no input in its tenant's objects",
                           code="input_not_found")
        size, chunks = await read_object(self.objects, job.input_ref)
        return Download("application/octet-stream", size, chunks)

    async def artifact_download(self, job: JobPage) -> Download:
        """The job's artifact as a stream of chunks, never read whole."""
        if not job.artifact:
            raise NotFound(f"the job is {job.status} and has no artifact",
                           code="artifact_not_found")
        size, chunks = await read_object(self.objects, str(job.artifact["uri"]))
        return Download(str(job.artifact.get("content_type") or "application/octet-stream"),
                        size, chunks)

    async def cancel(self, scope: uuid.UUID | None, job_id: uuid.UUID, by: str) -> None:
        job = await self.job(scope, job_id)
        if not await self.store.jobs.cancel(job.tenant_id, job_id, by=by):
            raise ContractError(f"the job is {job.status} already", code="job_terminal",
                                status=409)

    async def rerun(self, scope: uuid.UUID | None, job_id: uuid.UUID, from_step: str,
                    by: str) -> uuid.UUID:
        """A new job that reruns this one from ``from_step`` (calmq.reruns: the API's
        checks and refusals); its id."""
        reruns = Reruns(self.store, self.workflows)
        original = await reruns.original(job_id, scope)
        made = await reruns.write(original, reruns.plan(original, from_step), by=by)
        return made.job_id

    # -- reviews -----------------------------------------------------------------------------

    async def reviews(self, scope: uuid.UUID | None, limit: int = 100) -> list[QueuedReview]:
        return await self.reads.reviews(scope, limit)

    async def review(self, scope: uuid.UUID | None, job_id: uuid.UUID) -> Review:
        """One review, read by its id; NotFound or not_awaiting_review (409) otherwise."""
        found = await self.reads.review(scope, job_id)
        if found is not None:
            return found
        job = await self.job(scope, job_id)  # NotFound for an unknown or foreign job
        raise ContractError(f"the job is {job.status}, not awaiting review",
                            code="not_awaiting_review", status=409)

    async def decide(self, review: Review, decision: Decision) -> None:
        desk = ReviewDesk(self.store, self.workflows, self.objects)
        await desk.decide(review.tenant_id, review.id, decision)

    # -- dead letters ------------------------------------------------------------------------

    def _dead(self) -> DeadLetters:
        return DeadLetters(self.store, workflows=self.workflows, objects=self.objects,
                           children_in_flight=self.settings.children_in_flight_max)

    async def dead_letter_groups(self, scope: uuid.UUID | None) -> list[DeadLetterGroup]:
        return await self._dead().summary(DeadLetterFilter(tenant_id=scope))

    async def dead_letters(self, scope: uuid.UUID | None, *, workflow: str | None,
                           step: str | None, failure_class: str | None, code: str | None
                           ) -> list[DeadLetter]:
        rows = await self._dead().find(DeadLetterFilter(
            tenant_id=scope, failure_class=failure_class, code=code, workflow=workflow,
            limit=1000))
        return [r for r in rows if not step or r.step == step]

    async def redrive(self, ids: list[uuid.UUID], *, by: str, reason: str,
                      scope: uuid.UUID | None) -> list[RedriveOutcome]:
        return await self._dead().redrive(ids, by=by, reason=reason, tenant_id=scope)


def _public_attempt(attempt: dict[str, Any]) -> dict[str, Any]:
    """An attempt's record as its tenant may read it: its error with no internal host."""
    message = attempt.get("error_message")
    return attempt if not isinstance(message, str) else {**attempt,
                                                         "error_message": hide_hosts(message)}
