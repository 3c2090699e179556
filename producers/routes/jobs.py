"""The jobs resource: submit, read, list, follow (SSE), fetch the artifact, cancel, delete.

Nothing is written for a request that is rejected, and a rejected or failed submit leaves
no uploaded file behind. Every query is scoped by the caller's tenant; another tenant's job
id answers 404 exactly like an unknown one.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import json
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web
from prometheus_client import Counter, Histogram

from calmq.data import HistoryEvent, Idempotency, JobFilter, Tenant
from calmq.errors import ContractError, NotFound
from calmq.jobs import TERMINAL, Status
from calmq.lanes import choose_lane
from calmq.limits import check_metadata, trace_parent
from calmq.objects import ObjectRef, presigned_url, stat_object
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
from calmq.producers.models import Accepted, JobPage, JobView, SubmitRequest
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
from calmq.producers.timestamps import format_time, parse_time
from calmq.producers.uploads import delete_object, read_form, read_object, tenant_owns
from calmq.producers.views import event_view, job_summary, job_view
from calmq.producers.webhooks import check_callback_url
from calmq.workflows import Workflow, find_workflow

__all__ = ["ROUTES"]

ACCEPTED = Counter("calmq_jobs_accepted_total", "Jobs accepted by the API",
                   ["workflow", "priority"])
CANCELLED = Counter("calmq_jobs_cancelled_total", "Jobs cancelled through the API")
ACCEPT_SECONDS = Histogram("calmq_accept_seconds", "Time to accept a job",
                           buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1))

_SSE_KEEPALIVE = 15.0
_LIST_PARAMS = frozenset({"status", "workflow", "created_after", "created_before", "limit",
                          "cursor"})


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
    check_metadata(req.metadata, settings.max_metadata_bytes)
    workflow = find_workflow(req.workflow, workflows)
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
    lane = choose_lane(req.lane, req.priority, req.deadline_seconds,
                       bulk_lane=workflow.bulk_lane,
                       window_seconds=settings.batch_completion_window_seconds,
                       margin_seconds=settings.batch_deadline_margin_seconds)
    if req.callback_url is not None:
        await check_callback_url(req.callback_url, allow_private=settings.webhook_allow_private)
    key = request.headers.get("Idempotency-Key")
    # Printable ASCII only: aiohttp hands other header bytes over as lone surrogates, which
    # the key's text column cannot store.
    if key is not None and not (0 < len(key) <= 255 and key.isascii() and key.isprintable()):
        raise ContractError("Idempotency-Key must be 1 to 255 printable ASCII characters",
                            code="invalid_header")
    # Every field of the body but the workflow is a column of the job (calmq.data.NewJob).
    job = prepare(workflow, caller.id, **{**req.model_dump(exclude={"workflow"}), "input": data,
                                          "lane": lane},
                  trace_parent=trace_parent(request.headers.get("traceparent")))
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
    return web.json_response(
        {"job_id": str(new_id), "status": "queued", "status_url": f"/v1/jobs/{new_id}"},
        status=202,
    )


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


async def list_jobs(request: web.Request) -> web.Response:
    caller = await tenant(request)
    params = request.query
    unknown = sorted(set(params) - _LIST_PARAMS)
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
    )
    with request.app[GATES].hold("read", caller.id):
        rows = await request.app[STORE].jobs.page(which)
    page, more = rows[:page_size], len(rows) > page_size
    next_cursor = _encode_cursor(page[-1].created_at, page[-1].id) if more else None
    return web.json_response({"jobs": [job_summary(r) for r in page],
                              "next_cursor": next_cursor})


# -- notifications --------------------------------------------------------------------------------

def _last_event_id(request: web.Request) -> int:
    raw = request.headers.get("Last-Event-ID") or request.query.get("after") or "0"
    try:
        value = int(raw)
    except ValueError as exc:
        raise ContractError("Last-Event-ID is the id of an event this stream sent",
                            code="invalid_header") from exc
    return max(value, 0)


async def job_events(request: web.Request) -> web.StreamResponse:
    """Server-sent events: the job's history, then each new event as it is written.

    A tenant holds at most api_streams_per_tenant streams in this process (429
    too_many_streams past it). The table is read when the job's notification wakes the
    stream (or the hub reconnected), never for a keep-alive."""
    caller = await tenant(request)
    ident = job_id(request)
    after = _last_event_id(request)
    with request.app[GATES].hold("stream", caller.id):
        return await _stream(request, caller, ident, after)


async def _stream(request: web.Request, caller: Tenant, ident: uuid.UUID, after: int
                  ) -> web.StreamResponse:
    store, hub = request.app[STORE], request.app[HUB]

    async def read() -> tuple[str | None, list[HistoryEvent]]:
        return await store.jobs.status_and_events(caller.id, ident, after)

    wake = hub.subscribe(str(ident))  # before the first read, so no event falls in between
    try:
        status, rows = await read()
        if status is None:
            raise NotFound("no such job")
        resp = web.StreamResponse(headers={
            "Content-Type": "text/event-stream", "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no"})
        await resp.prepare(request)
        while True:
            for r in rows:
                data = json.dumps({"job_id": str(ident), **event_view(r)})
                await resp.write(f"id: {r.id}\nevent: {r.type}\ndata: {data}\n\n".encode())
                after = r.id
            if status in TERMINAL:
                await resp.write(f"event: end\ndata: {json.dumps({'status': status})}\n\n".encode())
                break
            try:
                await asyncio.wait_for(wake.wait(), timeout=_SSE_KEEPALIVE)
            except TimeoutError:
                # Nothing happened to the job (a notification would have woken the stream):
                # a comment keeps proxies from closing it, with no database read.
                await resp.write(b": keep-alive\n\n")
                rows = []
                if not hub.closing:
                    continue
            wake.clear()
            if hub.closing:  # shutting down: the client reconnects with Last-Event-ID
                break
            status, rows = await read()
            if status is None:
                break
        await resp.write_eof()
        return resp
    finally:
        hub.unsubscribe(str(ident), wake)


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
             "schema": {"type": "string", "minLength": 1, "maxLength": 255}}],
        # Both schemas are generated per workflow by producers.openapi.
        "requestBody": {"required": True, "content": {
            JSON: {"schema": ref("SubmitRequest")},
            "multipart/form-data": {"schema": ref("SubmitForm")}}},
        "responses": {"202": answer("accepted", Accepted),
                      **problems(400, 401, 403, 409, 413, 415, 422, 429, 503)},
    }),
    Route("GET", "/v1/jobs", list_jobs, {
        "operationId": "listJobs",
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
        "responses": {"200": {"description": "server-sent events; each data is a JobEvent",
                              "content": {"text/event-stream": {}}},
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
