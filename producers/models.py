"""Every body the API reads or writes, as a pydantic model: the one source of its shapes.

Request models validate what clients send (``producers.parsing``). Response models
describe what the API answers; producers/openapi.py generates /openapi.json from both, and
tests/unit/test_api_models.py holds the bodies ``producers.views`` builds to them. The
views build plain dicts rather than instances: a GET, a list page or an SSE stream would
otherwise pay a model construction and dump per job for a shape that is already right.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from calmq.jobs import Status
from calmq.limits import CONCURRENCY_KEY_PATTERN, MAX_CONCURRENCY_KEY

__all__ = [
    "Accepted",
    "Answered",
    "Artifact",
    "BatchDetail",
    "BatchInfo",
    "BatchJob",
    "BatchList",
    "BulkItem",
    "BulkSubmitRequest",
    "BulkSubmitted",
    "ChildPage",
    "ChildView",
    "DeadLetter",
    "DeadLetterList",
    "JobError",
    "JobEvent",
    "JobPage",
    "JobSummary",
    "JobView",
    "OutputDelta",
    "OutputReset",
    "Problem",
    "RedriveRequest",
    "Redriven",
    "RerunAccepted",
    "RerunRequest",
    "ReviewItem",
    "ReviewList",
    "ReviewRequest",
    "SubmitRequest",
    "Usage",
    "WorkflowInfo",
    "WorkflowList",
    "WorkflowStep",
]

_MAX_DEADLINE = 30 * 24 * 3600


# -- requests ----------------------------------------------------------------------------------

class SubmitRequest(BaseModel):
    """The body of POST /v1/jobs (or the fields of its multipart form)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    workflow: str = Field(min_length=1, max_length=100)
    # The workflow checks it against its own input model (documented per workflow).
    input: dict[str, Any] | None = None
    input_ref: str | None = Field(default=None, max_length=2000)
    priority: Literal["interactive", "bulk"] = "bulk"
    # batch: through the provider's batch API at its batch price, answered within its
    # completion window (bulk only; the deadline, if any, must leave the window)
    # (default: the workflow's lane for bulk work, else online)
    lane: Literal["online", "batch"] | None = None
    deadline_seconds: int | None = Field(default=None, gt=0, le=_MAX_DEADLINE)
    callback_url: str | None = Field(default=None, max_length=2000)
    metadata: dict[str, Any] = Field(default_factory=dict)
    # A key inside the tenant (e.g. a customer id): a workflow with a concurrency_limit runs
    # at most that many of one key's jobs at once. Printable, no surrounding spaces.
    concurrency_key: str | None = Field(default=None, min_length=1,
                                        max_length=MAX_CONCURRENCY_KEY,
                                        pattern=CONCURRENCY_KEY_PATTERN)


class BulkSubmitRequest(BaseModel):
    """The body of POST /v1/jobs/bulk: each item is a SubmitRequest body (JSON only) with
    an optional ``idempotency_key``; items are checked one by one, so a bad item is
    refused alone (its result), never the request."""

    model_config = ConfigDict(extra="forbid", strict=True)

    jobs: list[dict[str, Any]] = Field(
        min_length=1, description="at most api_bulk_max_jobs items (default 1,000), each a "
                                  "SubmitRequest plus an optional idempotency_key "
                                  "(1 to 255 printable ASCII characters)")


class ReviewRequest(BaseModel):
    """The body of POST /v1/jobs/{id}/review."""

    model_config = ConfigDict(extra="forbid", strict=True)

    decision: Literal["approve", "reject"]
    fields: dict[str, Any] = Field(default_factory=dict)
    # The recorded reviewer is the calling key's identity (``tenant <name> key <prefix>``);
    # what the body says is kept beside it as a note, never as the reviewer.
    reviewer: str | None = Field(default=None, min_length=1, max_length=200)
    reason: str | None = Field(default=None, max_length=1000)


class RedriveRequest(BaseModel):
    """The body of POST /v1/dead-letters/{job_id}/redrive."""

    model_config = ConfigDict(extra="forbid", strict=True)

    reason: str = Field(min_length=1, max_length=1000)
    # The recorded ``by`` is the calling key's identity; this free text is kept as ``by_note``.
    by: str | None = Field(default=None, min_length=1, max_length=200)
    dry_run: bool = False


class RerunRequest(BaseModel):
    """The body of POST /v1/jobs/{id}/rerun."""

    model_config = ConfigDict(extra="forbid", strict=True)

    from_step: str = Field(min_length=1, max_length=200,
                           description="the step the rerun starts at; the recorded outputs "
                                       "of the steps before it are reused, not run again")
    input: dict[str, Any] | None = Field(
        default=None, description="what from_step gets instead: the job's input when it is "
                                  "the first step, otherwise the previous step's output")
    priority: Literal["interactive", "bulk"] | None = Field(
        default=None, description="the rerun's priority (default: the original's)")


# -- responses ---------------------------------------------------------------------------------

class Accepted(BaseModel):
    """The 202 answer of POST /v1/jobs."""

    job_id: uuid.UUID
    status: Literal["queued"]
    status_url: str


class RerunAccepted(Accepted):
    """The 202 answer of POST /v1/jobs/{id}/rerun: a new job, linked to the original."""

    rerun_of: uuid.UUID
    from_step: str


class Artifact(BaseModel):
    """Where a job's result is: a reference into the object store, never the bytes."""

    model_config = ConfigDict(extra="allow")

    uri: str
    sha256: str
    content_type: str
    size: int
    download_url: str | None = Field(
        default=None,
        description="GET /v1/jobs/{id} only: a presigned HTTPS URL for an s3:// artifact "
                    "(no calmq key needed until download_expires_at), else this API's "
                    "artifact route, fetched with the tenant's key")
    download_expires_at: datetime | None = None


class JobError(BaseModel):
    """Why a job failed: a stable code, its failure class and a message for people."""

    model_config = ConfigDict(extra="allow", populate_by_name=True)

    code: str
    failure_class: str = Field(alias="class")
    message: str


class JobEvent(BaseModel):
    """One entry of a job's history (also the data of each SSE event)."""

    type: str
    at: datetime
    attempt: int
    detail: dict[str, Any]


class Usage(BaseModel):
    """Tokens and cost of every model call of the job so far, retries included."""

    input_tokens: int
    output_tokens: int
    cost_usd: float
    cached_input_tokens: int = Field(
        default=0, description="of input_tokens, those the provider read from its prompt "
                               "cache (billed at the cached price)")
    cache_write_tokens: int = Field(
        default=0, description="of input_tokens, those written to the provider's prompt "
                               "cache (Anthropic's cache writes, billed at its write price)")
    cache_saved_usd: float = Field(
        default=0.0, description="what the prompt cache saved against the same calls "
                                 "uncached (cache writes above the input price count "
                                 "against it)")


class JobSummary(BaseModel):
    """A job without its history: an entry of GET /v1/jobs."""

    job_id: uuid.UUID
    workflow: str
    status: Status
    attempt: int
    step: str
    artifact: Artifact | None
    error: JobError | None
    created_at: datetime
    updated_at: datetime
    metadata: dict[str, Any] = Field(
        default_factory=dict, description="the submit's metadata, as given (empty if none)")


class JobView(JobSummary):
    """GET /v1/jobs/{id}: the same shape at every stage (docs/reference/api.md)."""

    usage: Usage
    # Why a queued job waits (e.g. spend_cap_daily: its tenant is past its daily spend cap);
    # null when nothing holds it back.
    waiting_reason: str | None = None
    # The job whose step started this one (a child job: GET /v1/jobs/{id}/children lists
    # a parent's); null for a job submitted on its own.
    parent_id: uuid.UUID | None = None
    # The job this one reruns from a step (POST /v1/jobs/{id}/rerun); null for a submit.
    rerun_of: uuid.UUID | None = None
    events: list[JobEvent]


class Answered(JobView):
    """The 200 answer of POST /v1/jobs with ``Prefer: wait=N`` when the job was final
    within N seconds: its view, and its result inline."""

    result: Any = Field(description="the artifact's JSON when it is JSON of at most 1 MiB; "
                                    "else null (fetch artifact.download_url)")


class OutputDelta(BaseModel):
    """SSE ``output.delta``: a piece of a streamed step's text, as the model wrote it. The
    attempt's text is the concatenation of its deltas, seq 1, 2, ... in order (``offset``:
    the characters before this one); a final job's may come as one delta."""

    job_id: uuid.UUID
    type: Literal["output.delta"]
    step: str
    attempt: int
    seq: int
    offset: int
    text: str


class OutputReset(BaseModel):
    """SSE ``reset``: a new attempt of ``step`` streams from its start; drop the text of
    that step received so far (the deltas that follow are the new attempt's, from seq 1)."""

    job_id: uuid.UUID
    type: Literal["reset"]
    step: str | None
    attempt: int


class Redriven(JobView):
    """The answer of a redrive: the job, and what the redrive did to it."""

    redrive: dict[str, Any]


class ChildView(BaseModel):
    """A child job in its parent's page of children, ``index``: its place in the input."""

    job_id: uuid.UUID
    index: int
    workflow: str
    status: Status
    attempt: int
    step: str
    artifact: Artifact | None
    error: JobError | None
    created_at: datetime
    updated_at: datetime


class ChildPage(BaseModel):
    """GET /v1/jobs/{id}/children: a page of the job's children in input order, the
    children counted by status, its joins (newest first) and its own parent if any;
    ``next_cursor`` is None on the last page."""

    job_id: uuid.UUID
    parent_id: uuid.UUID | None
    counts: dict[str, int]
    total: int
    joins: list[dict[str, Any]]
    children: list[ChildView]
    next_cursor: str | None


class JobPage(BaseModel):
    """A page of GET /v1/jobs, newest first; ``next_cursor`` is None on the last page."""

    jobs: list[JobSummary]
    next_cursor: str | None


class ReviewItem(BaseModel):
    """A job waiting in ``awaiting_review``, with the output a person decides on."""

    job_id: uuid.UUID
    workflow: str
    step: str
    confidence: float | None
    output: dict[str, Any]
    requested_at: datetime
    deadline_at: datetime | None
    review_url: str


class ReviewList(BaseModel):
    reviews: list[ReviewItem]


class DeadLetter(BaseModel):
    """A dead-lettered job, with the error that put it there."""

    job_id: uuid.UUID
    workflow: str
    step: str
    attempt: int
    error: JobError | None
    created_at: datetime
    dead_lettered_at: datetime
    redrive_url: str


class DeadLetterList(BaseModel):
    dead_letters: list[DeadLetter]


class BatchInfo(BaseModel):
    """A provider batch of the batch lane (docs/how-to/batch-backfills.md)."""

    key: uuid.UUID = Field(description="calmq's id of the batch (sent to the provider)")
    provider: str
    model: str
    pool: str
    provider_id: str | None = Field(description="the provider's batch id (null: not yet)")
    state: Literal["creating", "submitted", "collected", "abandoned"]
    provider_status: str | None
    request_count: int
    created_at: datetime
    submitted_at: datetime | None
    ended_at: datetime | None
    collected_at: datetime | None
    counts: dict[str, Any]
    cancel_requested: bool
    cost_usd: float = Field(description="settled requests at the batch price")
    online_cost_usd: float = Field(description="what the same tokens cost online")
    savings_usd: float


class BatchJob(BaseModel):
    """One job attempt in a provider batch (``custom_id``: job id _ attempt)."""

    job_id: uuid.UUID
    attempt: int
    custom_id: str
    state: Literal["pending", "settled", "retried", "cancelled"]
    status: Status
    input_tokens: int
    output_tokens: int
    cost_usd: float
    online_cost_usd: float
    settled_at: datetime | None


class BatchList(BaseModel):
    """A page of GET /v1/batches, newest first; ``next_cursor`` is None on the last page."""

    batches: list[BatchInfo]
    next_cursor: str | None


class BatchDetail(BatchInfo):
    jobs: list[BatchJob] = Field(description="the caller's jobs in the batch")


class WorkflowStep(BaseModel):
    """One step of a workflow: where it runs and how its output is checked."""

    name: str
    pool: str
    timeout_seconds: float
    max_attempts: int
    output_schema: dict[str, Any] | None = Field(
        description="JSON Schema the step's output must fit (null: not checked)")


class ByReferenceInfo(BaseModel):
    """What a workflow takes as input by reference (a multipart file or input_ref)."""

    content_types: list[str]
    max_bytes: int


class WorkflowInfo(BaseModel):
    """A workflow a job may name: its version, input schema and steps."""

    name: str
    version: int
    pool: str
    input_schema: dict[str, Any] = Field(description="JSON Schema of the submit's input")
    output_schema: dict[str, Any] | None = Field(
        description="JSON Schema of the artifact (the last step's output); null: not checked")
    review_threshold: float | None = Field(
        description="results less confident than this wait for a person (null: never)")
    steps: list[WorkflowStep]
    by_reference: ByReferenceInfo | None = Field(
        default=None, description="what it takes by reference (null: only inline input)")


class WorkflowList(BaseModel):
    workflows: list[WorkflowInfo]


class BulkItem(BaseModel):
    """One item's answer in POST /v1/jobs/bulk: accepted (a new job), duplicate (its
    idempotency key named an earlier job: that job), or refused (``problem`` says why, as
    POST /v1/jobs would have answered it)."""

    index: int = Field(description="the item's place in the request's jobs, from 0")
    status: Literal["accepted", "duplicate", "refused"]
    job_id: uuid.UUID | None = None
    status_url: str | None = None
    problem: Problem | None = None


class BulkSubmitted(BaseModel):
    """The 200 answer of POST /v1/jobs/bulk: one result per item, in input order, and the
    counts."""

    results: list[BulkItem]
    accepted: int
    duplicate: int
    refused: int


class Problem(BaseModel):
    """RFC 9457 problem details, the body of every error; ``code`` is stable."""

    model_config = ConfigDict(extra="allow")

    type: str
    title: str
    status: int
    detail: str
    code: str
