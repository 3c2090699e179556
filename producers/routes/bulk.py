"""Bulk submit: POST /v1/jobs/bulk, up to api_bulk_max_jobs jobs in one request.

A backfill of 40,000 items should not be 40,000 requests and 40,000 transactions. Each item
is a POST /v1/jobs JSON body (plus an optional ``idempotency_key``) and goes through the
same checks as one (routes.jobs.checked_job: validation, storable text, metadata size,
input_ref, lane, callback URL); an item that fails one is refused alone, with the problem a
single submit would have answered. The items that pass are written, with their outbox rows
and keys, in ONE transaction (calmq.data.jobs.Jobs.submit_many); the answer is 200 with one
result per item, in input order, only after that COMMIT.

The request is one request for the key's rate limit (api_rate_per_second): the bound on a
bulk request is its item count and its body size, both settings. Quotas, spend caps and
fair share hold bulk jobs back exactly as they do single ones: they act when a job runs,
not when it is accepted.
"""

from __future__ import annotations

import hashlib
import json
import re
import time
import uuid
from typing import Any

from aiohttp import web
from prometheus_client import Counter

from calmq.data import Idempotency, NewJob
from calmq.errors import ContractError
from calmq.producers.auth import tenant
from calmq.producers.context import SETTINGS, STORE
from calmq.producers.intake import refusal
from calmq.producers.models import BulkSubmitRequest, BulkSubmitted, SubmitRequest
from calmq.producers.parsing import parse_json, validate
from calmq.producers.problems import problem
from calmq.producers.routes.jobs import ACCEPT_SECONDS, ACCEPTED, check_idempotency_key, checked_job
from calmq.producers.routing import JSON, Route, answer, json_body, problems

__all__ = ["ROUTES", "surely_storable"]

BULK_ITEMS = Counter("calmq_bulk_items_total", "Items of POST /v1/jobs/bulk by their answer",
                     ["status"])

_READ_CHUNK = 64 * 1024
# An item's canonical JSON (sorted keys, no spaces), the text its key's hash is taken of:
# json.dumps(body, sort_keys=True, ...) exactly, without building an encoder per item.
# Where text PostgreSQL cannot store (parsing.check_storable) can come from in a UTF-8 JSON
# body: a \u0000 escape, a surrogate's escape, or a surrogate's own bytes (json reads bytes
# with surrogatepass). A body with none of them needs no item walked for such text; one with
# any (an emoji's escaped surrogate pair, say) has each item checked as a single submit is.
_MAYBE_UNSTORABLE = re.compile(rb"\\u(?:0000|[dD][89a-fA-F])|\xed[\xa0-\xbf]")
_CANONICAL = json.JSONEncoder(sort_keys=True, separators=(",", ":"), ensure_ascii=False)


async def submit_bulk(request: web.Request) -> web.Response:
    started = time.perf_counter()
    caller = await tenant(request, "submit")
    settings = request.app[SETTINGS]
    items, storable = await _items(request, settings.api_bulk_max_body_bytes,
                                   settings.api_bulk_max_jobs)
    base = settings.api_problem_base_url
    results: list[dict[str, Any]] = [{}] * len(items)
    pending: list[tuple[int, NewJob, Idempotency | None]] = []
    for index, item in enumerate(items):
        try:
            job, idem = await _check(request, caller, item, storable)
        except ContractError as exc:
            results[index] = _refused(index, exc, base)
        else:
            pending.append((index, job, idem))
    if pending:
        await _write(request, caller.id, pending, results, base)
    counts = dict.fromkeys(("accepted", "duplicate", "refused"), 0)
    for result in results:
        counts[result["status"]] += 1
    for status, n in counts.items():
        if n:
            BULK_ITEMS.labels(status).inc(n)
    ACCEPT_SECONDS.observe(time.perf_counter() - started)
    return web.json_response({"results": results, **counts})


async def _write(request: web.Request, tenant_id: uuid.UUID,
                 pending: list[tuple[int, NewJob, Idempotency | None]],
                 results: list[dict[str, Any]], base: str) -> None:
    """Write the items that passed their checks (one transaction) and put each one's result
    at its index."""
    written = await request.app[STORE].jobs.submit_many(
        tenant_id, [(job, idem) for _, job, idem in pending])
    # Counted per workflow and priority once a request, not once an item: a label lookup
    # and an increment under the counter's lock each cost about as much as an item's dict.
    accepted: dict[tuple[str, str], int] = {}
    try:
        for (index, job, _), outcome in zip(pending, written, strict=True):
            if isinstance(outcome, BaseException):
                err = refusal(outcome)
                if not isinstance(err, ContractError):
                    raise err
                results[index] = _refused(index, err, base)
                continue
            ident, created = outcome
            if created:
                which = (job.workflow, job.priority)
                accepted[which] = accepted.get(which, 0) + 1
            text = str(ident)
            results[index] = {"index": index,
                              "status": "accepted" if created else "duplicate",
                              "job_id": text, "status_url": f"/v1/jobs/{text}"}
    finally:  # the transaction committed: its jobs count even if an answer fails
        for (workflow, priority), n in accepted.items():
            ACCEPTED.labels(workflow, priority).inc(n)


async def _items(request: web.Request, max_bytes: int, max_jobs: int
                 ) -> tuple[list[Any], bool]:
    """The body's ``jobs`` list, and whether the body holds no unstorable text for sure:
    415/400/422 as any body, 413 past the settings' bounds."""
    if request.content_type != "application/json":
        raise ContractError(f"send application/json, not {request.content_type!r}",
                            code="unsupported_media_type", status=415)
    # Read here with its own bound: the app's client_max_size (max_body_bytes) is sized for
    # one job, and a bulk body may hold a thousand.
    if (request.content_length or 0) > max_bytes:
        raise _too_large(max_bytes)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.content.iter_chunked(_READ_CHUNK):
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
        chunks.append(chunk)
    raw = b"".join(chunks)
    body = parse_json(raw)
    if not isinstance(body, dict):
        raise ContractError("the body must be a JSON object", code="invalid_body", status=422)
    jobs = body.get("jobs")
    if set(body) != {"jobs"} or not isinstance(jobs, list) or not jobs:
        raise ContractError('the body is {"jobs": [...]} with 1 or more jobs and nothing else',
                            code="invalid_body", status=422)
    if len(jobs) > max_jobs:
        raise ContractError(
            f"{len(jobs)} jobs in one request; at most {max_jobs} (setting "
            "api_bulk_max_jobs): send them in several", code="too_many_jobs", status=413)
    return jobs, surely_storable(raw)


def surely_storable(raw: bytes) -> bool:
    """True when the JSON body ``raw`` cannot hold text PostgreSQL refuses; False when it
    may (then each item is checked for it)."""
    return json.detect_encoding(raw) == "utf-8" and _MAYBE_UNSTORABLE.search(raw) is None


def _too_large(max_bytes: int) -> ContractError:
    return ContractError(f"the body is over the {max_bytes} byte limit of a bulk submit "
                         "(setting api_bulk_max_body_bytes): send fewer jobs a request",
                         code="body_too_large", status=413)


async def _check(request: web.Request, caller: Any, item: Any, storable: bool
                 ) -> tuple[NewJob, Idempotency | None]:
    """The item's job and its key, after the checks of a single submit (its text's too,
    unless ``storable``: the whole body was shown to hold none that cannot be stored)."""
    if not isinstance(item, dict):
        raise ContractError("each item of jobs is a JSON object", code="invalid_body",
                            status=422)
    body = dict(item)
    key = check_idempotency_key(body.pop("idempotency_key", None), "idempotency_key",
                                code="invalid_body")
    req = validate(SubmitRequest, body, text_checked=storable)
    job = await checked_job(request, caller, req, [])
    if key is None:
        return job, None
    # The item as sent, canonical (sorted keys, no spaces): the same item in a retried
    # request hashes the same whatever order its client wrote the keys in.
    canonical = _CANONICAL.encode(body)
    return job, Idempotency(key, hashlib.sha256(canonical.encode()).digest())


def _refused(index: int, exc: ContractError, base: str) -> dict[str, Any]:
    # The very problem object POST /v1/jobs would have answered (producers.problems), its
    # type under the same api_problem_base_url.
    body = problem(exc.status, exc.code, exc.message, base=base).text
    return {"index": index, "status": "refused", "problem": json.loads(body or "{}")}


ROUTES = [
    Route("POST", "/v1/jobs/bulk", submit_bulk, {
        "operationId": "submitJobs",
        "description": "Submit up to api_bulk_max_jobs jobs (default 1,000) in one request "
                       "and one transaction. Each item is a POST /v1/jobs JSON body with an "
                       "optional idempotency_key, checked on its own: a bad item is refused "
                       "in its result and the others are written.",
        "requestBody": json_body(BulkSubmitRequest),
        "responses": {"200": answer("one result per item, in input order", BulkSubmitted,
                                    JSON),
                      **problems(400, 401, 403, 413, 415, 422, 429, 503)},
    }),
]
