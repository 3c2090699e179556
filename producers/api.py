"""The intake API (aiohttp): accept jobs fast and durably, show them, notify about them.

Every error is application/problem+json with a stable ``code`` (docs/reference/api.md).
Nothing is written for a request that is rejected. Every query is scoped by the caller's
tenant, and another tenant's job id answers 404 exactly like an unknown one.

Routes are registered in ``ROUTES`` (method, path, handler); producers/openapi.py documents
the same list and a unit test holds the two in step. Other issues' endpoints (reviews,
dead letters) add their rows to ``ROUTES`` or call ``app.router`` after ``build_app``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import hashlib
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any, Literal

from aiohttp import BodyPartReader, web
from aiohttp.http_exceptions import HttpProcessingError
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from calmq import sql
from calmq.errors import CalmqError, ContractError, NotFound
from calmq.jobs import TERMINAL, Status
from calmq.objects import ObjectRef, ObjectStore, open_object_store
from calmq.producers.backlog import QueueAge
from calmq.producers.intake import GroupCommit, insert_params, prepare
from calmq.producers.notifications import KEYS, WEBHOOKS, Hub
from calmq.producers.problems import problem
from calmq.producers.retention import Sweeper, purge
from calmq.producers.uploads import delete_object, read_object, store_stream, tenant_owns
from calmq.producers.webhooks import Dispatcher, check_callback_url
from calmq.reviews import Decision, ReviewDesk
from calmq.settings import Settings
from calmq.store import Store, Tenant
from calmq.workflows import Workflow, find_workflow, load_workflows

__all__ = ["ROUTES", "RedriveRequest", "SubmitRequest", "build_app", "job_view"]

log = logging.getLogger(__name__)

ACCEPTED = Counter("calmq_jobs_accepted_total", "Jobs accepted by the API",
                   ["workflow", "priority"])
REJECTED = Counter("calmq_requests_rejected_total", "Requests rejected", ["code"])
CANCELLED = Counter("calmq_jobs_cancelled_total", "Jobs cancelled through the API")
ACCEPT_SECONDS = Histogram("calmq_accept_seconds", "Time to accept a job",
                           buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1))

_STORE = web.AppKey("store", Store)
_SETTINGS = web.AppKey("settings", Settings)
_WORKFLOWS = web.AppKey("workflows", dict)
_OBJECTS = web.AppKey("objects", ObjectStore)
_AUTH_CACHE = web.AppKey("auth_cache", dict)
_GROUP = web.AppKey("group_commit", GroupCommit)
_HUB = web.AppKey("hub", Hub)

_LIST_MAX = 200
_SSE_KEEPALIVE = 15.0
_FIELD_MAX = 1024 * 1024  # a non-file multipart field; the JSON body has the same limit


class SubmitRequest(BaseModel):
    """The body of POST /v1/jobs."""

    model_config = ConfigDict(extra="forbid", strict=True)

    workflow: str = Field(min_length=1, max_length=100)
    input: dict[str, Any] | None = None
    input_ref: str | None = Field(default=None, max_length=2000)
    priority: Literal["interactive", "bulk"] = "bulk"
    deadline_seconds: int | None = Field(default=None, gt=0, le=30 * 24 * 3600)
    callback_url: str | None = Field(default=None, max_length=2000)
    metadata: dict[str, Any] = Field(default_factory=dict)


def _json_error(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}" for e in exc.errors()
    )


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    try:
        return await handler(request)  # type: ignore[no-any-return]
    except ContractError as exc:
        REJECTED.labels(exc.code).inc()
        return problem(exc.status, exc.code, exc.message)
    except web.HTTPRequestEntityTooLarge:
        REJECTED.labels("body_too_large").inc()
        return problem(413, "body_too_large",
                       f"the body is over the {request.app[_SETTINGS].max_body_bytes} byte limit")
    except web.HTTPNotFound:
        return problem(404, "no_route", f"no route for {request.method} {request.path}")
    except web.HTTPMethodNotAllowed:
        return problem(405, "method_not_allowed",
                       f"{request.method} is not allowed on {request.path}")
    except CalmqError as exc:
        log.exception("request failed")
        return problem(503, exc.code, exc.message)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except web.HTTPException as exc:
        return problem(exc.status, "http_error", exc.reason)
    except Exception:
        log.exception("unexpected error")
        return problem(500, "internal_error", "an unexpected error; it has been logged")


# -- authentication ---------------------------------------------------------------------------

async def _tenant(request: web.Request) -> Tenant:
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ContractError("send Authorization: Bearer <api key>", code="missing_api_key",
                            status=401)
    key = key.strip()
    cache: dict[str, tuple[float, Tenant | None]] = request.app[_AUTH_CACHE]
    now = time.monotonic()
    hit = cache.get(key)
    if hit is not None and hit[0] > now:
        tenant = hit[1]
    else:
        tenant = await request.app[_STORE].tenant_for_key(key)
        if len(cache) > 10_000:
            cache.clear()
        cache[key] = (now + request.app[_SETTINGS].auth_cache_seconds, tenant)
    if tenant is None:
        raise ContractError("the API key is unknown or revoked", code="invalid_api_key",
                            status=401)
    return tenant


# -- submit -------------------------------------------------------------------------------------

async def _read_json(request: web.Request) -> tuple[dict[str, Any], bytes]:
    if request.content_type != "application/json":
        raise ContractError(
            f"send application/json or multipart/form-data, not {request.content_type!r}",
            code="unsupported_media_type", status=415,
        )
    raw = await request.read()
    try:
        body = json.loads(raw)
    except ValueError as exc:
        raise ContractError(f"the body is not valid JSON: {exc}", code="invalid_json") from exc
    if not isinstance(body, dict):
        raise ContractError("the body must be a JSON object", code="invalid_body", status=422)
    return body, raw


async def _field_text(part: Any) -> str:
    data = bytearray()
    while chunk := await part.read_chunk(64 * 1024):
        data += chunk
        if len(data) > _FIELD_MAX:
            raise ContractError(f"field {part.name} is over {_FIELD_MAX} bytes",
                                code="body_too_large", status=413)
    try:
        return data.decode(part.get_charset(default="utf-8"))
    except (UnicodeDecodeError, LookupError) as exc:
        raise ContractError(f"field {part.name} is not text", code="invalid_multipart") from exc


async def _read_multipart(
    request: web.Request, tenant: Tenant, stored: list[ObjectRef]
) -> tuple[dict[str, Any], bytes]:
    """Fields plus a ``file`` part streamed to the object store (appended to ``stored``)."""
    settings = request.app[_SETTINGS]
    fields: dict[str, Any] = {}
    digest = hashlib.sha256()
    try:
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader) or not part.name:
                raise ContractError("every part needs a name; nested multipart is not supported",
                                    code="invalid_multipart")
            if part.name == "file":
                if stored:
                    raise ContractError("send one part named file", code="invalid_multipart")
                ref = await store_stream(
                    request.app[_OBJECTS], f"{tenant.id}/inputs/{uuid.uuid4()}", part,
                    part.headers.get("Content-Type", "application/octet-stream")[:200],
                    settings.max_upload_bytes)
                stored.append(ref)
                digest.update(f"file={ref.sha256}".encode())
            else:
                if part.name in fields:
                    raise ContractError(f"field {part.name} is sent twice",
                                        code="invalid_multipart")
                text = await _field_text(part)
                fields[part.name] = text
                digest.update(f"{part.name}={text}".encode())
    except (ValueError, AssertionError, RuntimeError, HttpProcessingError) as exc:
        # aiohttp's reader raises these for a missing boundary, a bad part header or a body
        # that ends mid-part.
        raise ContractError(f"the multipart body is malformed: {exc}",
                            code="invalid_multipart") from exc
    for name in ("input", "metadata"):
        if name in fields:
            try:
                fields[name] = json.loads(fields[name])
            except ValueError as exc:
                raise ContractError(f"field {name} is not JSON", code="invalid_json") from exc
    if "deadline_seconds" in fields:
        try:
            fields["deadline_seconds"] = int(fields["deadline_seconds"])
        except ValueError as exc:
            raise ContractError("deadline_seconds is not an integer", code="invalid_body",
                                status=422) from exc
    if not stored:
        raise ContractError("a multipart submit needs a part named file", code="missing_file",
                            status=422)
    if "input" in fields or "input_ref" in fields:
        raise ContractError("a multipart submit carries its input as the file part",
                            code="invalid_body", status=422)
    fields["input_ref"] = stored[0].uri
    return fields, digest.digest()


async def submit(request: web.Request) -> web.Response:
    started = time.perf_counter()
    tenant = await _tenant(request)
    stored: list[ObjectRef] = []
    try:
        response = await _submit(request, tenant, stored)
    except BaseException:
        for ref in stored:  # a rejected or failed request leaves nothing behind
            await asyncio.shield(delete_object(request.app[_OBJECTS], ref.uri))
        raise
    ACCEPT_SECONDS.observe(time.perf_counter() - started)
    return response


async def _submit(request: web.Request, tenant: Tenant, stored: list[ObjectRef]) -> web.Response:
    settings = request.app[_SETTINGS]
    multipart = request.content_type.startswith("multipart/")
    if multipart:
        body, raw = await _read_multipart(request, tenant, stored)
    else:
        body, raw = await _read_json(request)
    try:
        req = SubmitRequest.model_validate(body)
    except ValidationError as exc:
        raise ContractError(_json_error(exc), code="invalid_body", status=422) from exc
    workflow: Workflow = find_workflow(req.workflow, request.app[_WORKFLOWS])
    if (req.input is None) == (req.input_ref is None):
        raise ContractError("send exactly one of input and input_ref", code="invalid_body",
                            status=422)
    data = workflow.validate_input(req.input) if req.input is not None else None
    if req.input_ref is not None and not multipart and not tenant_owns(
            settings.object_store_url, tenant.id, req.input_ref):
        raise ContractError("input_ref must point inside your tenant's prefix of the store",
                            code="input_ref_forbidden", status=403)
    if req.callback_url is not None:
        await check_callback_url(req.callback_url, allow_private=settings.webhook_allow_private)
    key = request.headers.get("Idempotency-Key")
    if key is not None and not (0 < len(key) <= 255):
        raise ContractError("Idempotency-Key must be 1 to 255 characters", code="invalid_header")
    job, event, route = prepare(
        workflow, tenant.id, input=data, input_ref=req.input_ref, priority=req.priority,
        deadline_seconds=req.deadline_seconds, callback_url=req.callback_url,
        metadata=req.metadata, trace_parent=request.headers.get("traceparent"),
        idempotency_key=key,
        request_hash=(raw if multipart else hashlib.sha256(raw).digest()) if key else None,
    )
    if key is None:
        await request.app[_GROUP].submit(insert_params(job, event, route))
        job_id, created = job.id, True
    else:
        # With a key, the key row must be written in the job's transaction and a concurrent
        # twin must see it: the store's one-job transaction does both.
        job_id, created = await request.app[_STORE].submit(job, event, route)
    if created:
        ACCEPTED.labels(job.workflow, job.priority).inc()
    else:
        for ref in stored:  # the earlier job has its own copy of the file
            await delete_object(request.app[_OBJECTS], ref.uri)
        stored.clear()
    stored.clear()  # committed: the object now belongs to the job
    return web.json_response(
        {"job_id": str(job_id), "status": "queued", "status_url": f"/v1/jobs/{job_id}"},
        status=202,
    )


# -- reading ------------------------------------------------------------------------------------

def _job_id(request: web.Request) -> uuid.UUID:
    try:
        return uuid.UUID(request.match_info["job_id"])
    except ValueError:
        raise NotFound("no such job") from None


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _summary(job: dict[str, Any]) -> dict[str, Any]:
    return {
        "job_id": str(job["id"]),
        "workflow": job["workflow"],
        "status": job["status"],
        "attempt": job["attempt"],
        "step": job["step"],
        "artifact": job["artifact"],
        "error": job["error"],
        "created_at": _iso(job["created_at"]),
        "updated_at": _iso(job["updated_at"]),
    }


def _event(e: dict[str, Any]) -> dict[str, Any]:
    return {"type": e["type"], "at": _iso(e["at"]), "attempt": e["attempt"], "detail": e["detail"]}


def job_view(job: dict[str, Any]) -> dict[str, Any]:
    """The stable shape of GET /v1/jobs/{id} (DESIGN.md §4)."""
    return {**_summary(job), "usage": _usage(job), "events": [_event(e) for e in job["events"]]}


def _usage(job: dict[str, Any]) -> dict[str, Any]:
    """Tokens and cost of every model call of the job so far, retries included."""
    return {"input_tokens": int(job.get("input_tokens") or 0),
            "output_tokens": int(job.get("output_tokens") or 0),
            "cost_usd": float(job.get("cost_usd") or 0)}


async def get_job(request: web.Request) -> web.Response:
    tenant = await _tenant(request)
    job = await request.app[_STORE].job_view(tenant.id, _job_id(request))
    if job is None:
        raise NotFound("no such job")
    return web.json_response(job_view(job))


_LIST_PARAMS = frozenset({"status", "workflow", "created_after", "created_before", "limit",
                          "cursor"})


def _timestamp(name: str, value: str | None) -> datetime | None:
    if value is None:
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError as exc:
        raise ContractError(f"{name} is not an ISO 8601 timestamp", code="invalid_query") from exc
    if parsed.tzinfo is None:
        raise ContractError(f"{name} needs a time zone (e.g. Z or +00:00)", code="invalid_query")
    return parsed


def _cursor(value: str | None) -> tuple[datetime | None, uuid.UUID | None]:
    if value is None:
        return None, None
    try:
        at, _, ident = base64.urlsafe_b64decode(value.encode() + b"==").decode().partition("|")
        return datetime.fromisoformat(at), uuid.UUID(ident)
    except (ValueError, binascii.Error, UnicodeDecodeError) as exc:
        raise ContractError("cursor is not one this API gave out", code="invalid_cursor") from exc


async def list_jobs(request: web.Request) -> web.Response:
    tenant = await _tenant(request)
    query = request.query
    unknown = sorted(set(query) - _LIST_PARAMS)
    if unknown:
        raise ContractError(f"unknown query parameter(s) {', '.join(unknown)}",
                            code="invalid_query")
    statuses = [s for v in query.getall("status", []) for s in v.split(",") if s] or None
    valid = {s.value for s in Status}
    if statuses and not set(statuses) <= valid:
        raise ContractError(f"status is one of {', '.join(sorted(valid))}", code="invalid_query")
    limit = _limit(query, default=50)
    cursor_at, cursor_id = _cursor(query.get("cursor"))
    params = {
        "tenant_id": tenant.id, "statuses": statuses, "workflow": query.get("workflow"),
        "created_after": _timestamp("created_after", query.get("created_after")),
        "created_before": _timestamp("created_before", query.get("created_before")),
        "cursor_at": cursor_at, "cursor_id": cursor_id, "limit": limit + 1,
    }
    async with request.app[_STORE].pool.connection() as conn:
        cur = await conn.execute(sql.queries()["api_list_jobs"], params)
        rows = await cur.fetchall()
    page, more = rows[:limit], len(rows) > limit
    next_cursor = None
    if more:
        last = page[-1]
        next_cursor = base64.urlsafe_b64encode(
            f"{last['created_at'].isoformat()}|{last['id']}".encode()).decode().rstrip("=")
    return web.json_response({"jobs": [_summary(r) for r in page], "next_cursor": next_cursor})


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
    """Server-sent events: the job's history, then each new event as it is written."""
    tenant = await _tenant(request)
    job_id = _job_id(request)
    after = _last_event_id(request)
    store, hub, q = request.app[_STORE], request.app[_HUB], sql.queries()

    async def read() -> tuple[str | None, list[dict[str, Any]]]:
        async with store.pool.connection() as conn:
            # Status first, then events: a terminal status implies its event is visible.
            cur = await conn.execute(q["api_job_status"], {"id": job_id, "tenant_id": tenant.id})
            row = await cur.fetchone()
            if row is None:
                return None, []
            cur = await conn.execute(q["api_job_events_after"], {"id": job_id, "after": after})
            return row["status"], await cur.fetchall()

    wake = hub.subscribe(str(job_id))  # before the first read, so no event falls in between
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
                data = json.dumps({"job_id": str(job_id), **_event(r)})
                await resp.write(f"id: {r['id']}\nevent: {r['type']}\ndata: {data}\n\n".encode())
                after = r["id"]
            if status in TERMINAL:
                await resp.write(f"event: end\ndata: {json.dumps({'status': status})}\n\n".encode())
                break
            try:
                await asyncio.wait_for(wake.wait(), timeout=_SSE_KEEPALIVE)
            except TimeoutError:
                await resp.write(b": keep-alive\n\n")
            wake.clear()
            if hub.closing:  # shutting down: the client reconnects with Last-Event-ID
                break
            status, rows = await read()
            if status is None:
                break
        await resp.write_eof()
        return resp
    finally:
        hub.unsubscribe(str(job_id), wake)


# -- artifact, cancel, delete ---------------------------------------------------------------------

async def get_artifact(request: web.Request) -> web.StreamResponse:
    tenant = await _tenant(request)
    job = await request.app[_STORE].job_view(tenant.id, _job_id(request))
    if job is None:
        raise NotFound("no such job")
    artifact = job["artifact"]
    if not artifact:
        raise NotFound(f"the job is {job['status']} and has no artifact",
                       code="artifact_not_found")
    size, chunks = await read_object(request.app[_OBJECTS], artifact["uri"])
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
    tenant = await _tenant(request)
    job_id = _job_id(request)
    store = request.app[_STORE]
    if not await store.cancel(tenant.id, job_id):
        job = await store.job_view(tenant.id, job_id)
        if job is None:
            raise NotFound("no such job")
        raise ContractError(f"the job is {job['status']} already", code="job_terminal",
                            status=409)
    CANCELLED.inc()
    job = await store.job_view(tenant.id, job_id)
    assert job is not None
    return web.json_response(job_view(job))


async def delete_job(request: web.Request) -> web.Response:
    tenant = await _tenant(request)
    await purge(request.app[_STORE], request.app[_OBJECTS], request.app[_SETTINGS],
                tenant.id, _job_id(request))
    return web.Response(status=204)


# -- human review (calmq/reviews.py) ------------------------------------------------------------

class ReviewRequest(BaseModel):
    """The body of POST /v1/jobs/{id}/review."""

    model_config = ConfigDict(extra="forbid", strict=True)

    decision: Literal["approve", "reject"]
    fields: dict[str, Any] = Field(default_factory=dict)
    reviewer: str = Field(min_length=1, max_length=200)
    reason: str | None = Field(default=None, max_length=1000)


def _desk(request: web.Request) -> ReviewDesk:
    return ReviewDesk(request.app[_STORE], request.app[_WORKFLOWS], request.app[_OBJECTS])


async def review_job(request: web.Request) -> web.Response:
    tenant = await _tenant(request)
    job_id = _job_id(request)
    body, _raw = await _read_json(request)
    try:
        req = ReviewRequest.model_validate(body)
    except ValidationError as exc:
        raise ContractError(_json_error(exc), code="invalid_body", status=422) from exc
    await _desk(request).decide(tenant.id, job_id,
                                Decision(req.decision, req.reviewer, req.fields, req.reason))
    job = await request.app[_STORE].job_view(tenant.id, job_id)
    assert job is not None
    return web.json_response(job_view(job))


def _limit(query: Mapping[str, str], *, default: int) -> int:
    """The ``limit`` of a list endpoint: 1 to _LIST_MAX, else 400 invalid_query."""
    try:
        limit = int(query.get("limit", str(default)))
    except ValueError:
        limit = 0
    if not 1 <= limit <= _LIST_MAX:
        raise ContractError(f"limit is an integer from 1 to {_LIST_MAX}", code="invalid_query")
    return limit


async def list_reviews(request: web.Request) -> web.Response:
    tenant = await _tenant(request)
    limit = _limit(request.query, default=100)
    rows = await _desk(request).pending(tenant.id, limit=limit)
    return web.json_response({"reviews": [
        {"job_id": str(r["id"]), "workflow": r["workflow"], "step": r["step"],
         "confidence": r["confidence"], "output": r["output"],
         "requested_at": _iso(r["updated_at"]), "deadline_at": _iso(r["review_deadline_at"]),
         "review_url": f"/v1/jobs/{r['id']}/review"}
        for r in rows
    ]})


# -- dead letters ----------------------------------------------------------------------------------

class RedriveRequest(BaseModel):
    """The body of POST /v1/dead-letters/{job_id}/redrive."""

    model_config = ConfigDict(extra="forbid", strict=True)

    reason: str = Field(min_length=1, max_length=1000)
    by: str | None = Field(default=None, min_length=1, max_length=200)  # default: the tenant
    dry_run: bool = False


def _when(request: web.Request, name: str) -> datetime | None:
    text = request.query.get(name)
    if text is None:
        return None
    try:
        return datetime.fromisoformat(text)
    except ValueError:
        raise ContractError(f"{name} is an ISO 8601 time", code="invalid_query",
                            status=422) from None


async def list_dead_letters(request: web.Request) -> web.Response:
    from calmq.deadletters import DeadLetterFilter, DeadLetters

    tenant = await _tenant(request)
    limit = _limit(request.query, default=100)
    where = DeadLetterFilter(
        tenant_id=tenant.id, failure_class=request.query.get("failure_class"),
        code=request.query.get("code"), workflow=request.query.get("workflow"),
        since=_when(request, "since"), until=_when(request, "until"), limit=limit)
    rows = await DeadLetters(request.app[_STORE], workflows=request.app[_WORKFLOWS]).find(where)
    return web.json_response({"dead_letters": [
        {"job_id": str(r["id"]), "workflow": r["workflow"], "step": r["step"],
         "attempt": r["attempt"], "error": r["error"], "created_at": _iso(r["created_at"]),
         "dead_lettered_at": _iso(r["dead_lettered_at"]),
         "redrive_url": f"/v1/dead-letters/{r['id']}/redrive"}
        for r in rows
    ]})


async def redrive_dead_letter(request: web.Request) -> web.Response:
    from calmq.deadletters import DeadLetters

    tenant = await _tenant(request)
    job_id = _job_id(request)
    body, _raw = await _read_json(request)
    try:
        req = RedriveRequest.model_validate(body)
    except ValidationError as exc:
        raise ContractError(_json_error(exc), code="invalid_body", status=422) from exc
    dead = DeadLetters(request.app[_STORE], workflows=request.app[_WORKFLOWS],
                       objects=request.app[_OBJECTS])
    [outcome] = await dead.redrive([job_id], by=req.by or f"tenant {tenant.name}",
                                   reason=req.reason, tenant_id=tenant.id, dry_run=req.dry_run)
    if outcome.outcome == "skipped":
        raise ContractError(outcome.message, code=outcome.code or "not_dead_lettered",
                            status=409)
    if outcome.outcome == "rejected":
        raise ContractError(outcome.message, code=outcome.code or "redrive_rejected",
                            status=409 if outcome.code == "deadline_passed" else 422)
    job = await request.app[_STORE].job_view(tenant.id, job_id)
    assert job is not None
    return web.json_response({**job_view(job), "redrive": outcome.as_dict()})


# -- operations ----------------------------------------------------------------------------------

async def healthz(_request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def readyz(request: web.Request) -> web.Response:
    try:
        async with request.app[_STORE].pool.connection() as conn:
            await conn.execute("SELECT 1")
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        return problem(503, "database_unavailable", f"PostgreSQL does not answer: {exc}")
    return web.json_response({"ok": True})


async def metrics(_request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


async def openapi(_request: web.Request) -> web.Response:
    from calmq.producers.openapi import document

    return web.json_response(document())


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# (method, path, handler): the API's surface, documented route by route in openapi.py.
ROUTES: list[tuple[str, str, Handler]] = [
    ("POST", "/v1/jobs", submit),
    ("GET", "/v1/jobs", list_jobs),
    ("GET", "/v1/jobs/{job_id}", get_job),
    ("DELETE", "/v1/jobs/{job_id}", delete_job),
    ("GET", "/v1/jobs/{job_id}/events", job_events),
    ("GET", "/v1/jobs/{job_id}/artifact", get_artifact),
    ("POST", "/v1/jobs/{job_id}/cancel", cancel_job),
    ("POST", "/v1/jobs/{job_id}/review", review_job),
    ("GET", "/v1/reviews", list_reviews),
    ("GET", "/v1/dead-letters", list_dead_letters),
    ("POST", "/v1/dead-letters/{job_id}/redrive", redrive_dead_letter),
    ("GET", "/healthz", healthz),
    ("GET", "/readyz", readyz),
    ("GET", "/metrics", metrics),
    ("GET", "/openapi.json", openapi),
]


def build_app(
    settings: Settings,
    store: Store,
    *,
    workflows: dict[str, Workflow] | None = None,
    objects: ObjectStore | None = None,
    background: bool = True,
) -> web.Application:
    """The API application; ``background`` starts LISTEN, webhooks and retention with it."""
    app = web.Application(middlewares=[_errors], client_max_size=settings.max_body_bytes)
    app[_STORE] = store
    app[_SETTINGS] = settings
    app[_WORKFLOWS] = workflows or load_workflows(settings)
    app[_OBJECTS] = objects or open_object_store(settings.object_store_url)
    app[_AUTH_CACHE] = {}
    app[_GROUP] = GroupCommit(store.pool, max_batch=settings.accept_batch_max)
    app[_HUB] = Hub(settings.database_url)
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)

    hub = app[_HUB]
    hub.on(KEYS, app[_AUTH_CACHE].clear)  # a revoked key stops working at once
    dispatcher = Dispatcher(settings, store, job_view)
    sweeper = Sweeper(settings, store, app[_OBJECTS])
    queue_age = QueueAge(store, settings.queue_age_interval_seconds)

    async def start_background(_app: web.Application) -> None:
        if not background:
            return
        hub.start()
        if settings.webhook_dispatcher:
            hub.on(WEBHOOKS, dispatcher.wake)
            dispatcher.start()
        sweeper.start()
        queue_age.start()

    async def stop_background(_app: web.Application) -> None:
        for part in (queue_age, sweeper, dispatcher, hub):
            with contextlib.suppress(Exception):
                await part.stop()
        await store.close()

    async def close_streams(_app: web.Application) -> None:
        hub.close_streams()  # open SSE streams must not hold the shutdown for a minute

    app.on_startup.append(start_background)
    app.on_shutdown.append(close_streams)
    app.on_cleanup.append(stop_background)
    return app
