"""The jobs resource: submit, read, list, follow (SSE), fetch the artifact, cancel, delete.

Nothing is written for a request that is rejected, and a rejected or failed submit leaves
no uploaded file behind. Every query is scoped by the caller's tenant; another tenant's job
id answers 404 exactly like an unknown one.

A submit with ``Prefer: wait=N`` (RFC 7240) is held up to N seconds (at most the setting
api_prefer_wait_max_seconds): a job final by then is answered 200 with its view and result
(``Preference-Applied``), otherwise the usual 202 -- also when the wait itself fails (the
job is committed by then). The event stream carries a streamed
step's text beside the history (producers/job_stream.py).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import logging
import re
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web
from multidict import MultiMapping
from prometheus_client import Counter, Histogram

from calmq.calls import Position
from calmq.data import HistoryEvent, Idempotency, JobFilter, NewJob, Tenant
from calmq.data.outputs import FOLLOW_REFRESH_SECONDS
from calmq.errors import ContractError, NotFound
from calmq.jobs import TERMINAL, Status
from calmq.lanes import choose_lane
from calmq.limits import check_metadata, trace_parent
from calmq.objects import ObjectRef, presigned_url, read_bounded, stat_object
from calmq.producers.auth import tenant
from calmq.producers.context import (
    GATES,
    GROUP_COMMIT,
    HUB,
    OBJECTS,
    SETTINGS,
    STORE,
    WORKFLOWS,
)
from calmq.producers.intake import prepare, submit_keyed
from calmq.producers.job_stream import JobStream
from calmq.producers.models import Accepted, Answered, JobPage, JobView, SubmitRequest
from calmq.producers.parsing import job_id, limit, read_body, validate
from calmq.producers.retention import purge
from calmq.producers.routing import (
    JOB_ID,
    JSON,
    LIMIT,
    Route,
    answer,
    problems,
    query,
    ref,
)
from calmq.producers.throttle import Throttled
from calmq.producers.timestamps import format_time, parse_time
from calmq.producers.uploads import delete_object, read_form, read_object, tenant_owns
from calmq.producers.views import job_summary, job_view
from calmq.producers.webhooks import check_callback_url
from calmq.workflows import Workflow, find_workflow

__all__ = ["ROUTES", "check_idempotency_key", "checked_job"]

log = logging.getLogger(__name__)

ACCEPTED = Counter("calmq_jobs_accepted_total", "Jobs accepted by the API",
                   ["workflow", "priority"])
CANCELLED = Counter("calmq_jobs_cancelled_total", "Jobs cancelled through the API")
ACCEPT_SECONDS = Histogram("calmq_accept_seconds", "Time to accept a job",
                           buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1))

# Every field of the body but the workflow is a column of the job (calmq.data.NewJob).
_COLUMNS = tuple(name for name in SubmitRequest.model_fields if name != "workflow")
_SSE_KEEPALIVE = 15.0
_LIST_PARAMS = frozenset({"status", "workflow", "created_after", "created_before", "limit",
                          "cursor"})
# GET /v1/jobs?metadata.<key>=<value>: a filter by one of the submit's metadata values.
_METADATA = "metadata."
_METADATA_KEY_MAX = 200


# -- submit -------------------------------------------------------------------------------------

async def submit(request: web.Request) -> web.Response:
    started = time.perf_counter()
    caller = await tenant(request, "submit")
    stored: list[ObjectRef] = []
    try:
        response = await _submit(request, caller, stored)
    except BaseException:
        for obj in stored:  # a rejected or failed request leaves nothing behind
            await asyncio.shield(delete_object(request.app[OBJECTS], obj.uri))
        raise
    ACCEPT_SECONDS.observe(time.perf_counter() - started)
    return response


async def _submit(request: web.Request, caller: Tenant, stored: list[ObjectRef]
                  ) -> web.Response:
    settings = request.app[SETTINGS]
    multipart = request.content_type.startswith("multipart/")
    workflows = request.app[WORKFLOWS]
    if multipart:
        fields, raw = await read_form(request, request.app[OBJECTS], f"{caller.id}/inputs",
                                      settings.max_upload_bytes, stored,
                                      max_parts=settings.max_multipart_parts,
                                      max_field_bytes=settings.max_multipart_field_bytes,
                                      file_limit=lambda seen: _file_limit(workflows, seen))
        req = validate(SubmitRequest, fields)
    else:
        req, raw = await read_body(request, SubmitRequest)
    job = await checked_job(request, caller, req, stored, multipart=multipart)
    key = check_idempotency_key(request.headers.get("Idempotency-Key"), "Idempotency-Key",
                                code="invalid_header")
    if key is None:
        await request.app[GROUP_COMMIT].submit(job)
        new_id, created = job.id, True
    else:
        # With a key, the key row must be written in the job's transaction and a concurrent
        # twin must see it: the store's one-job transaction does both.
        new_id, created = await submit_keyed(request.app[STORE], job, Idempotency(
            key, raw if multipart else hashlib.sha256(raw).digest()))
    if created:
        ACCEPTED.labels(job.workflow, job.priority).inc()
    else:
        for obj in stored:  # the earlier job has its own copy of the file
            await delete_object(request.app[OBJECTS], obj.uri)
    stored.clear()  # committed: the object now belongs to the job
    wait = _preferred_wait(request.headers.getall("Prefer", []),
                           settings.api_prefer_wait_max_seconds)
    if wait:
        try:
            answered = await _answer_when_final(request, caller, new_id, wait)
        except Exception:  # the job is committed: the answer is its 202
            # Whatever fails while waiting (the database away, the artifact unreadable), the
            # submit itself succeeded: an error here would have the client send it again.
            log.warning("Prefer: wait for job %s failed after its commit; answering 202",
                        new_id, exc_info=True)
            answered = None
        if answered is not None:
            return answered
    return web.json_response(
        {"job_id": str(new_id), "status": "queued", "status_url": f"/v1/jobs/{new_id}"},
        status=202,
    )


async def checked_job(request: web.Request, caller: Tenant, req: SubmitRequest,
                      stored: list[ObjectRef], *, multipart: bool = False) -> NewJob:
    """The job of a validated submit body after every intake check of the body's fields
    (metadata size, workflow and its input, input_ref, lane, callback URL); a ContractError
    names the first that fails. POST /v1/jobs and each item of POST /v1/jobs/bulk go
    through here, so a bulk item is refused for exactly what a single submit is."""
    settings = request.app[SETTINGS]
    check_metadata(req.metadata, settings.max_metadata_bytes)
    workflow = find_workflow(req.workflow, request.app[WORKFLOWS])
    if (req.input is None) == (req.input_ref is None):
        raise ContractError("send exactly one of input and input_ref", code="invalid_body",
                            status=422)
    data = workflow.validate_input(req.input) if req.input is not None else None
    if req.input_ref is not None and not multipart and not tenant_owns(
            settings.object_store_url, caller.id, req.input_ref):
        raise ContractError("input_ref must point inside your tenant's prefix of the store",
                            code="input_ref_forbidden", status=403)
    if req.input_ref is not None:
        await _check_reference(request, workflow, req.input_ref, stored)
    deadline = req.deadline_seconds or workflow.deadline_seconds  # the workflow's default
    lane = choose_lane(req.lane, req.priority, deadline, bulk_lane=workflow.bulk_lane,
                       window_seconds=settings.batch_completion_window_seconds,
                       margin_seconds=settings.batch_deadline_margin_seconds)
    if req.callback_url is not None:
        await check_callback_url(req.callback_url, allow_private=settings.webhook_allow_private)
    # Read field by field rather than model_dump(): the values are validated already, and a
    # dump copies input and metadata once more for every job (each item of a bulk submit).
    columns = {name: getattr(req, name) for name in _COLUMNS}
    return prepare(workflow, caller.id, **{**columns, "input": data, "lane": lane},
                   trace_parent=trace_parent(request.headers.get("traceparent")))


def check_idempotency_key(key: str | None, where: str, *, code: str) -> str | None:
    """``key`` if it is one an idempotency key may be: 1 to 255 printable ASCII characters
    (aiohttp hands other header bytes over as lone surrogates, which the key's text column
    cannot store); else ContractError 400 ``code``."""
    if key is not None and not (isinstance(key, str) and 0 < len(key) <= 255
                                and key.isascii() and key.isprintable()):
        raise ContractError(f"{where} must be 1 to 255 printable ASCII characters", code=code)
    return key


_WAIT = re.compile(r'^\s*wait\s*=\s*"?(\d{1,9})"?\s*$', re.IGNORECASE)
# A result up to this size comes inline in a 200 answer to Prefer: wait (larger: the link).
_INLINE_RESULT_BYTES = 1024 * 1024


def _preferred_wait(values: list[str], cap: float) -> int:
    """The seconds a submit may be held: ``wait=N`` among the ``Prefer`` headers' comma-
    separated preferences (RFC 7240 section 4.3, delta-seconds), at most ``cap``; 0 when
    not asked. A preference the server cannot use is ignored, as RFC 7240 says."""
    for value in values:
        for preference in value.split(","):
            found = _WAIT.match(preference.split(";", 1)[0])
            if found:
                return min(int(found[1]), int(cap))
    return 0


async def _answer_when_final(request: web.Request, caller: Tenant, ident: uuid.UUID,
                             seconds: int) -> web.Response | None:
    """200 with the job's view and result if it is final within ``seconds``, else None.

    The wait holds one of the tenant's stream places (api_streams_per_tenant) and no
    database connection: it reads the job when its notification comes. A tenant at its
    cap gets the 202 at once."""
    store, hub = request.app[STORE], request.app[HUB]
    wake = hub.subscribe(str(ident))
    try:
        with request.app[GATES].hold("stream", caller.id):
            deadline = time.monotonic() + seconds
            while True:
                job = await store.jobs.view(caller.id, ident)
                if job is None:
                    return None  # deleted meanwhile: the 202 still names it
                if job.status in TERMINAL:
                    break
                left = deadline - time.monotonic()
                if left <= 0 or hub.closing:
                    return None
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(left):
                        await wake.wait()
                wake.clear()
    except Throttled:
        return None
    finally:
        hub.unsubscribe(str(ident), wake)
    view = job_view(job)
    result: Any = None
    if view.get("artifact"):
        artifact = view["artifact"]
        view["artifact"] = {**artifact, **_download(request, job.id, artifact)}
        result = await _inline_result(request, artifact)
    return web.json_response({**view, "result": result}, status=200,
                             headers={"Preference-Applied": f"wait={seconds}"})


async def _inline_result(request: web.Request, artifact: dict[str, Any]) -> Any:
    """The artifact's JSON, when it is JSON and small enough to answer inline."""
    if not str(artifact.get("content_type", "")).startswith("application/json") or int(
            artifact.get("size") or 0) > _INLINE_RESULT_BYTES:
        return None
    raw = await read_bounded(request.app[OBJECTS], str(artifact["uri"]), _INLINE_RESULT_BYTES)
    try:
        return json.loads(raw)
    except ValueError:
        return None


def _file_limit(workflows: dict[str, Workflow], fields: Mapping[str, Any]) -> int | None:
    """A multipart file's own limit when its workflow field came first: the workflow's."""
    found = workflows.get(str(fields.get("workflow", "")))
    return found.by_reference.max_bytes if found and found.by_reference else None


async def _check_reference(request: web.Request, workflow: Workflow, uri: str,
                           stored: list[ObjectRef]) -> None:
    """Input by reference obeys the workflow's rules: it must take input by reference, of
    this media type and size (the upload as received, or the object as stored)."""
    accepts = workflow.accepts_reference()
    if stored:
        accepts.check(workflow.name, stored[0].content_type, stored[0].size)
        return
    try:
        info = await stat_object(request.app[OBJECTS], uri)
    except NotFound:
        raise ContractError("input_ref names no object in the store; upload it first",
                            code="input_ref_not_found", status=422) from None
    accepts.check(workflow.name, info.content_type, info.size)


# -- reading ------------------------------------------------------------------------------------

async def get_job(request: web.Request) -> web.Response:
    caller = await tenant(request)
    job = await request.app[STORE].jobs.view(caller.id, job_id(request))
    if job is None:
        raise NotFound("no such job")
    view = job_view(job)
    if view.get("artifact"):
        view["artifact"] = {**view["artifact"], **_download(request, job.id, view["artifact"])}
    return web.json_response(view)


def _download(request: web.Request, ident: uuid.UUID, artifact: dict[str, Any]
              ) -> dict[str, Any]:
    """Where a consumer fetches the artifact: a presigned S3 URL (no calmq key needed, for
    artifact_link_seconds), else this API's artifact route (with the tenant's key)."""
    seconds = request.app[SETTINGS].artifact_link_seconds
    url = presigned_url(request.app[OBJECTS], str(artifact.get("uri", "")), seconds)
    if url is None:
        return {"download_url": f"/v1/jobs/{ident}/artifact", "download_expires_at": None}
    expires = datetime.now(UTC) + timedelta(seconds=seconds)
    return {"download_url": url, "download_expires_at": format_time(expires)}


def _encode_cursor(created_at: datetime, ident: uuid.UUID) -> str:
    text = f"{format_time(created_at)}|{ident}"
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _decode_cursor(value: str | None) -> tuple[datetime | None, uuid.UUID | None]:
    if value is None:
        return None, None
    try:
        at, _, ident = base64.urlsafe_b64decode(value.encode() + b"==").decode().partition("|")
        return parse_time("cursor", at), uuid.UUID(ident)
    except (ContractError, ValueError, binascii.Error, UnicodeDecodeError) as exc:
        raise ContractError("cursor is not one this API gave out",
                            code="invalid_cursor") from exc


def metadata_filter(params: MultiMapping[str]) -> dict[str, str] | None:
    """The ``metadata.<key>=<value>`` parameters of a list as one JSON object a job's
    metadata must contain (every pair: AND; a value matches a string value exactly), or
    None. The jobs_metadata GIN index serves the containment (migration 0031)."""
    found: dict[str, str] = {}
    for name in params:
        if not name.startswith(_METADATA):
            continue
        key, values = name[len(_METADATA):], params.getall(name)
        if not key or len(key) > _METADATA_KEY_MAX or len(values) > 1:
            raise ContractError(f"{name}: a metadata filter is metadata.<key>=<value>, "
                                f"one value per key (keys up to {_METADATA_KEY_MAX} "
                                "characters)", code="invalid_query")
        found[key] = values[0]
    return found or None


async def list_jobs(request: web.Request) -> web.Response:
    caller = await tenant(request)
    params = request.query
    unknown = sorted(p for p in set(params) - _LIST_PARAMS if not p.startswith(_METADATA))
    if unknown:
        raise ContractError(f"unknown query parameter(s) {', '.join(unknown)}",
                            code="invalid_query")
    statuses = [s for v in params.getall("status", []) for s in v.split(",") if s] or None
    valid = {s.value for s in Status}
    if statuses and not set(statuses) <= valid:
        raise ContractError(f"status is one of {', '.join(sorted(valid))}", code="invalid_query")
    page_size = limit(params, default=50)
    cursor_at, cursor_id = _decode_cursor(params.get("cursor"))
    which = JobFilter(
        tenant_id=caller.id, statuses=statuses, workflow=params.get("workflow"),
        created_after=parse_time("created_after", params.get("created_after")),
        created_before=parse_time("created_before", params.get("created_before")),
        cursor_at=cursor_at, cursor_id=cursor_id, limit=page_size + 1,
        metadata=metadata_filter(params),
    )
    with request.app[GATES].hold("read", caller.id):
        rows = await request.app[STORE].jobs.page(which)
    page, more = rows[:page_size], len(rows) > page_size
    next_cursor = _encode_cursor(page[-1].created_at, page[-1].id) if more else None
    return web.json_response({"jobs": [job_summary(r) for r in page],
                              "next_cursor": next_cursor})


# -- notifications --------------------------------------------------------------------------------

def _last_event_id(request: web.Request) -> Position:
    raw = request.headers.get("Last-Event-ID") or request.query.get("after") or "0"
    return Position.parse(raw)


async def job_events(request: web.Request) -> web.StreamResponse:
    """Server-sent events: the job's history, then each new event as it is written, and a
    streamed step's text as ``output.delta`` events (``reset`` when a new attempt of the
    step begins), resumable with ``Last-Event-ID``.

    A tenant holds at most api_streams_per_tenant streams in this process (429
    too_many_streams past it). The history is read when the job's notification wakes the
    stream (or the hub reconnected), never for a keep-alive; deltas come with their own
    notification, and the table is read only to start, after a gap, and at the end."""
    caller = await tenant(request)
    ident = job_id(request)
    after = _last_event_id(request)
    with request.app[GATES].hold("stream", caller.id):
        return await _stream(request, caller, ident, after)


async def _stream(request: web.Request, caller: Tenant, ident: uuid.UUID, after: Position
                  ) -> web.StreamResponse:
    store, hub = request.app[STORE], request.app[HUB]
    follower = JobStream(ident, after)

    async def history() -> tuple[str | None, list[HistoryEvent]]:
        return await store.jobs.status_and_events(caller.id, ident, follower.position.history)

    async def table() -> list[bytes]:
        feed.take()  # what was announced before this read is in it
        pos = follower.position
        return follower.from_read(await store.outputs.after(ident, pos.stream, pos.seq))

    # Before the first read, so that nothing falls in between. The follow (job_followers)
    # is what makes workers announce the job's text at all; a chunk committed before it is
    # in the table read, and one whose announcement it just missed shows as a gap at the
    # next chunk (the table is read then) or is in the final read.
    wake = hub.subscribe(str(ident))
    feed = hub.follow_output(str(ident), wake)
    stream_id = uuid.uuid4()
    await store.outputs.follow(ident, stream_id)
    followed = time.monotonic()
    try:
        status, rows = await history()
        feed.take_events()
        if status is None:
            raise NotFound("no such job")
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        read_table = True
        while True:
            # The output first: a history event read is never ahead of the text before it
            # (a step's chunks are written before its outcome).
            if read_table:
                frames = await table()
            else:
                chunks, gap = feed.take()
                fed = None if gap else follower.from_feed(chunks)
                frames = fed if fed is not None else await table()
            frames += follower.history(rows)
            if frames:
                await resp.write(b"".join(frames))
            if status in TERMINAL:
                end = json.dumps({"status": status})
                await resp.write(f"event: end\ndata: {end}\n\n".encode())
                break
            rows, read_table = [], False
            try:
                async with asyncio.timeout(_SSE_KEEPALIVE):
                    await wake.wait()
            except TimeoutError:
                # Nothing happened to the job (a notification would have woken the stream):
                # a comment keeps proxies from closing it, with no database read.
                await resp.write(b": keep-alive\n\n")
                if not hub.closing:
                    continue
            wake.clear()
            if hub.closing:  # shutting down: the client reconnects with Last-Event-ID
                break
            if time.monotonic() - followed > FOLLOW_REFRESH_SECONDS:
                await store.outputs.follow(ident, stream_id)
                followed = time.monotonic()
            if feed.take_events():
                status, rows = await history()
                if status is None:
                    break
                # Final: every chunk is written by now; the table has them all.
                read_table = status in TERMINAL
        await resp.write_eof()
        return resp
    finally:
        hub.unfollow_output(str(ident), feed)
        hub.unsubscribe(str(ident), wake)
        await store.outputs.unfollow(ident, stream_id)


# -- artifact, cancel, delete ---------------------------------------------------------------------

async def get_artifact(request: web.Request) -> web.StreamResponse:
    caller = await tenant(request)
    with request.app[GATES].hold("read", caller.id):
        return await _artifact(request, caller)


async def _artifact(request: web.Request, caller: Tenant) -> web.StreamResponse:
    job = await request.app[STORE].jobs.view(caller.id, job_id(request))
    if job is None:
        raise NotFound("no such job")
    artifact = job.artifact
    if not artifact:
        raise NotFound(f"the job is {job.status} and has no artifact",
                       code="artifact_not_found")
    size, chunks = await read_object(request.app[OBJECTS], artifact["uri"])
    resp = web.StreamResponse(headers={
        "Content-Type": str(artifact.get("content_type") or "application/octet-stream"),
        "Content-Length": str(size),
        "ETag": f'"{artifact.get("sha256", "")}"'})
    await resp.prepare(request)
    async for chunk in chunks:
        await resp.write(chunk)
    await resp.write_eof()
    return resp


async def cancel_job(request: web.Request) -> web.Response:
    caller = await tenant(request, "submit", "operate")
    ident = job_id(request)
    store = request.app[STORE]
    if not await store.jobs.cancel(caller.id, ident, by=caller.identity):
        job = await store.jobs.view(caller.id, ident)
        if job is None:
            raise NotFound("no such job")
        raise ContractError(f"the job is {job.status} already", code="job_terminal",
                            status=409)
    CANCELLED.inc()
    job = await store.jobs.view(caller.id, ident)
    assert job is not None
    return web.json_response(job_view(job))


async def delete_job(request: web.Request) -> web.Response:
    caller = await tenant(request, "submit")
    await purge(request.app[STORE], request.app[OBJECTS], request.app[SETTINGS],
                caller.id, job_id(request))
    return web.Response(status=204)


_DATE_TIME = {"type": "string", "format": "date-time"}

ROUTES = [
    Route("POST", "/v1/jobs", submit, {
        "operationId": "submitJob",
        "parameters": [
            {"name": "Idempotency-Key", "in": "header", "required": False,
             "schema": {"type": "string", "minLength": 1, "maxLength": 255}},
            {"name": "Prefer", "in": "header", "required": False,
             "schema": {"type": "string", "example": "wait=5"},
             "description": "RFC 7240 wait=N: hold the answer up to N seconds (at most the "
                            "setting api_prefer_wait_max_seconds); a job final by then is "
                            "answered 200 with its view and result"}],
        # Both schemas are generated per workflow by producers.openapi.
        "requestBody": {"required": True, "content": {
            JSON: {"schema": ref("SubmitRequest")},
            "multipart/form-data": {"schema": ref("SubmitForm")}}},
        "responses": {"200": {**answer("Prefer: wait=N and the job was final within it: "
                                       "its view and result", Answered),
                              "headers": {"Preference-Applied": {
                                  "description": "wait=N, the seconds the answer could "
                                                 "wait", "schema": {"type": "string"}}}},
                      "202": answer("accepted", Accepted),
                      **problems(400, 401, 403, 409, 413, 415, 422, 429, 503)},
    }),
    Route("GET", "/v1/jobs", list_jobs, {
        "operationId": "listJobs",
        "description": "Filters: status, workflow, created_after/created_before, and any "
                       "number of metadata.<key>=<value> parameters (a job whose metadata "
                       "holds the string value at that key; several: all of them), e.g. "
                       "?metadata.batch=2026-12-07. Paginated by cursor like every list.",
        "parameters": [
            query("status", {"type": "string"},
                  "one status or a comma list: " + ", ".join(s.value for s in Status)),
            query("workflow", {"type": "string"}),
            query("created_after", _DATE_TIME),
            query("created_before", _DATE_TIME),
            LIMIT,
            query("cursor", {"type": "string"})],
        "responses": {"200": answer("a page of jobs, newest first", JobPage),
                      **problems(400, 401, 429)},
    }),
    Route("GET", "/v1/jobs/{job_id}", get_job, {
        "operationId": "getJob", "parameters": [JOB_ID],
        "responses": {"200": answer("the job", JobView), **problems(401, 404, 429)},
    }),
    Route("DELETE", "/v1/jobs/{job_id}", delete_job, {
        "operationId": "deleteJob", "parameters": [JOB_ID],
        "responses": {"204": answer("objects purged, record redacted"),
                      **problems(401, 403, 404, 409, 429)},
    }),
    Route("GET", "/v1/jobs/{job_id}/events", job_events, {
        "operationId": "jobEvents", "parameters": [
            JOB_ID,
            {"name": "Last-Event-ID", "in": "header", "required": False,
             "schema": {"type": "string"}}],
        "responses": {"200": {"description": "server-sent events: each history event's "
                                             "data is a JobEvent; a streamed step's text "
                                             "comes as output.delta events (OutputDelta), "
                                             "a new attempt's as reset (OutputReset); the "
                                             "last is end",
                              "content": {"text/event-stream": {"schema": {"oneOf": [
                                  ref("JobEvent"), ref("OutputDelta"),
                                  ref("OutputReset")]}}}},
                      **problems(400, 401, 404, 429)},
    }),
    Route("GET", "/v1/jobs/{job_id}/artifact", get_artifact, {
        "operationId": "getArtifact", "parameters": [JOB_ID],
        "responses": {"200": answer("the artifact's bytes"), **problems(401, 404, 429)},
    }),
    Route("POST", "/v1/jobs/{job_id}/cancel", cancel_job, {
        "operationId": "cancelJob", "parameters": [JOB_ID],
        "responses": {"200": answer("cancelled", JobView),
                      **problems(401, 403, 404, 409, 429)},
    }),
]
