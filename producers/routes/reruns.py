"""Rerun from a step over HTTP: POST /v1/jobs/{id}/rerun makes a new job (calmq.reruns).

A rerun is a submit: the submit role, the key's rate limit, the callback URL checked again
(the original's, which may no longer resolve where it did), an optional ``Idempotency-Key``
as POST /v1/jobs takes it, and the same 202 answer, with the original's id beside the new
one. Another tenant's job id answers 404.
"""

from __future__ import annotations

import hashlib

from aiohttp import web
from prometheus_client import Counter

from calmq.data import Idempotency
from calmq.producers.auth import tenant
from calmq.producers.context import SETTINGS, STORE, WORKFLOWS
from calmq.producers.models import RerunAccepted, RerunRequest
from calmq.producers.parsing import job_id, read_body
from calmq.producers.routes.jobs import check_idempotency_key
from calmq.producers.routing import JOB_ID, Route, answer, json_body, problems
from calmq.producers.webhooks import check_callback_url
from calmq.reruns import Reruns

__all__ = ["ROUTES"]

RERUNS = Counter("calmq_jobs_rerun_total", "Jobs rerun from a step through the API",
                 ["workflow"])


async def rerun_job(request: web.Request) -> web.Response:
    caller = await tenant(request, "submit")
    ident = job_id(request)
    req, raw = await read_body(request, RerunRequest)
    key = check_idempotency_key(request.headers.get("Idempotency-Key"), "Idempotency-Key",
                                code="invalid_header")
    # As POST /v1/jobs: the same key with the same request answers the same new job, another
    # request under it 409 idempotency_key_reused. The hash covers the job rerun too, so a
    # key is never answered with a rerun of another job (nor with a submit's job).
    keyed = None if key is None else Idempotency(
        key, hashlib.sha256(f"POST /v1/jobs/{ident}/rerun\n".encode() + raw).digest())
    reruns = Reruns(request.app[STORE], request.app[WORKFLOWS])
    if keyed is not None:
        again = await reruns.replay(ident, req.from_step, tenant_id=caller.id,
                                    idempotency=keyed)
        if again is not None:
            return web.json_response(again.as_dict(), status=202)
    original = await reruns.original(ident, caller.id)
    plan = reruns.plan(original, req.from_step, replacement=req.input, priority=req.priority)
    if plan.job.callback_url is not None:
        await check_callback_url(plan.job.callback_url,
                                 allow_private=request.app[SETTINGS].webhook_allow_private)
    rerun = await reruns.write(original, plan, by=caller.identity, idempotency=keyed)
    if rerun.created:
        RERUNS.labels(plan.job.workflow).inc()
    return web.json_response(rerun.as_dict(), status=202)


ROUTES = [
    Route("POST", "/v1/jobs/{job_id}/rerun", rerun_job, {
        "operationId": "rerunJob",
        "parameters": [JOB_ID, {
            "name": "Idempotency-Key", "in": "header", "required": False,
            "description": "the same key with the same body answers the same new job; "
                           "another body (or job) under it answers 409 "
                           "idempotency_key_reused",
            "schema": {"type": "string", "minLength": 1, "maxLength": 255}}],
        "requestBody": json_body(RerunRequest),
        "responses": {"202": answer("a new job, from the step; the steps before it reuse "
                                    "the original's recorded outputs", RerunAccepted),
                      **problems(400, 401, 403, 404, 409, 415, 422, 429, 503)},
    }),
]
