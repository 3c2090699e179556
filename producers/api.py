"""The intake API (aiohttp): accept a job in one transaction and answer 202; show its status.

Every error is application/problem+json with a stable ``code`` (docs/reference/api.md).
Nothing is written for a request that is rejected.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from calmq import events, topics
from calmq.errors import CalmqError, ContractError, NotFound
from calmq.objects import ObjectStore, open_object_store
from calmq.settings import Settings
from calmq.store import NewJob, Store, Tenant
from calmq.workflows import Workflow, builtin_workflows, find_workflow
from producers.problems import problem

__all__ = ["SubmitRequest", "build_app"]

log = logging.getLogger(__name__)

ACCEPTED = Counter("calmq_jobs_accepted_total", "Jobs accepted by the API", ["workflow", "priority"])
REJECTED = Counter("calmq_requests_rejected_total", "Requests rejected", ["code"])
ACCEPT_SECONDS = Histogram("calmq_accept_seconds", "Time to accept a job",
                           buckets=(0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 1))

_STORE = web.AppKey("store", Store)
_SETTINGS = web.AppKey("settings", Settings)
_WORKFLOWS = web.AppKey("workflows", dict)
_OBJECTS = web.AppKey("objects", ObjectStore)  # type: ignore[type-abstract]
_AUTH_CACHE = web.AppKey("auth_cache", dict)


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
        return problem(405, "method_not_allowed", f"{request.method} is not allowed on {request.path}")
    except CalmqError as exc:
        log.exception("request failed")
        return problem(503, exc.code, exc.message)


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


async def _read_multipart(request: web.Request, tenant: Tenant) -> tuple[dict[str, Any], bytes]:
    """Fields plus a ``file`` part, stored in the object store; the job gets its reference."""
    objects = request.app[_OBJECTS]
    reader = await request.multipart()
    fields: dict[str, Any] = {}
    digest = hashlib.sha256()
    file_ref: str | None = None
    while (part := await reader.next()) is not None:
        if not isinstance(part, web.BodyPartReader) or part.name is None:  # type: ignore[attr-defined]
            raise ContractError("nested multipart is not supported", code="invalid_multipart")
        if part.name == "file":
            data = await part.read()
            digest.update(data)
            ref = await objects.put(f"{tenant.id}/inputs/{uuid.uuid4()}",
                                    bytes(data), part.headers.get("Content-Type", "application/octet-stream"))
            file_ref = ref.uri
        else:
            text = await part.text()
            fields[part.name] = text
            digest.update(f"{part.name}={text}".encode())
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
    if file_ref is None:
        raise ContractError("a multipart submit needs a part named file", code="missing_file",
                            status=422)
    fields["input_ref"] = file_ref
    return fields, digest.digest()


async def submit(request: web.Request) -> web.Response:
    started = time.perf_counter()
    tenant = await _tenant(request)
    settings = request.app[_SETTINGS]
    if request.content_type.startswith("multipart/"):
        body, raw = await _read_multipart(request, tenant)
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
    if req.input_ref is not None and not request.content_type.startswith("multipart/"):
        _check_input_ref(req.input_ref, tenant, settings)
    key = request.headers.get("Idempotency-Key")
    if key is not None and not (0 < len(key) <= 255):
        raise ContractError("Idempotency-Key must be 1 to 255 characters", code="invalid_header")
    first = workflow.steps[0]
    job = NewJob(
        id=uuid.uuid4(),
        tenant_id=tenant.id,
        workflow=workflow.name,
        workflow_version=workflow.version,
        priority=req.priority,
        pool=first.pool or workflow.pool,
        step=first.name,
        max_attempts=first.max_attempts,
        input=data,
        input_ref=req.input_ref,
        metadata=req.metadata,
        callback_url=req.callback_url,
        deadline_at=(datetime.now(UTC) + timedelta(seconds=req.deadline_seconds)
                     if req.deadline_seconds else None),
        trace_parent=request.headers.get("traceparent"),
        idempotency_key=key,
        request_hash=hashlib.sha256(raw).digest() if key is not None else None,
    )
    row = {"id": job.id, "tenant_id": job.tenant_id, "workflow": job.workflow,
           "workflow_version": job.workflow_version, "step": job.step, "attempt": 0,
           "priority": job.priority, "pool": job.pool, "input_ref": job.input_ref,
           "deadline_at": job.deadline_at, "trace_parent": job.trace_parent}
    event = events.requested(row)
    event.pop("created_at")  # the database's commit-side clock fills it in
    job_id, created = await request.app[_STORE].submit(
        job, event, topics.work_route(job.pool, job.priority)
    )
    if created:
        ACCEPTED.labels(job.workflow, job.priority).inc()
    ACCEPT_SECONDS.observe(time.perf_counter() - started)
    return web.json_response(
        {"job_id": str(job_id), "status": "queued", "status_url": f"/v1/jobs/{job_id}"},
        status=202,
    )


def _check_input_ref(ref: str, tenant: Tenant, settings: Settings) -> None:
    base = settings.object_store_url.rstrip("/")
    prefix = f"{base}/{tenant.id}/"
    if not ref.startswith(prefix) or "/../" in ref[len(base):] or ref.endswith("/.."):
        raise ContractError("input_ref must point inside your tenant's prefix of the store",
                            code="input_ref_forbidden", status=403)


def _job_id(request: web.Request) -> uuid.UUID:
    try:
        return uuid.UUID(request.match_info["job_id"])
    except ValueError:
        raise NotFound("no such job") from None


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def job_view(job: dict[str, Any]) -> dict[str, Any]:
    """The stable shape of GET /v1/jobs/{id} (DESIGN.md §4)."""
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
        "events": [
            {"type": e["type"], "at": _iso(e["at"]), "attempt": e["attempt"], "detail": e["detail"]}
            for e in job["events"]
        ],
    }


async def get_job(request: web.Request) -> web.Response:
    tenant = await _tenant(request)
    job = await request.app[_STORE].job_view(tenant.id, _job_id(request))
    if job is None:
        raise NotFound("no such job")
    return web.json_response(job_view(job))


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
    job = await store.job_view(tenant.id, job_id)
    assert job is not None
    return web.json_response(job_view(job))


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
    from producers.openapi import document

    return web.json_response(document())


def build_app(
    settings: Settings,
    store: Store,
    *,
    workflows: dict[str, Workflow] | None = None,
    objects: ObjectStore | None = None,
) -> web.Application:
    app = web.Application(middlewares=[_errors], client_max_size=settings.max_body_bytes)
    app[_STORE] = store
    app[_SETTINGS] = settings
    app[_WORKFLOWS] = workflows or builtin_workflows()
    app[_OBJECTS] = objects or open_object_store(settings.object_store_url)
    app[_AUTH_CACHE] = {}
    app.router.add_post("/v1/jobs", submit)
    app.router.add_get("/v1/jobs/{job_id}", get_job)
    app.router.add_post("/v1/jobs/{job_id}/cancel", cancel_job)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/openapi.json", openapi)

    async def close_store(_app: web.Application) -> None:
        await store.close()

    app.on_cleanup.append(close_store)
    return app
