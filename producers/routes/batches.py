"""Provider batches of the batch lane over HTTP: the ones holding the tenant's jobs, one
with its jobs, and cancelling one (docs/how-to/batch-backfills.md)."""

from __future__ import annotations

import base64
import binascii
import uuid
from datetime import datetime

from aiohttp import web

from calmq.data.batches import BatchSummary
from calmq.errors import ContractError, NotFound
from calmq.producers.auth import tenant
from calmq.producers.context import GATES, STORE
from calmq.producers.models import BatchDetail, BatchList
from calmq.producers.parsing import limit
from calmq.producers.routing import LIMIT, Route, answer, problems, query
from calmq.producers.timestamps import format_time, parse_time

__all__ = ["ROUTES"]

_STATES = ("creating", "submitted", "collected", "abandoned")
BATCH_ID = {"name": "batch_id", "in": "path", "required": True, "schema": {"type": "string"},
            "description": "calmq's batch key or the provider's batch id"}


async def _found(request: web.Request) -> tuple[BatchSummary, uuid.UUID]:
    caller = await tenant(request)
    ref = request.match_info["batch_id"]
    found = await request.app[STORE].batches.find(ref, tenant_id=caller.id) \
        if len(ref) <= 200 and "\x00" not in ref else None
    if found is None:
        raise NotFound("no batch holding your jobs has that id", code="batch_not_found")
    return found, caller.id


def _encode_cursor(created_at: datetime, key: uuid.UUID) -> str:
    text = f"{format_time(created_at)}|{key}"
    return base64.urlsafe_b64encode(text.encode()).decode().rstrip("=")


def _decode_cursor(value: str | None) -> tuple[datetime, uuid.UUID] | None:
    if value is None:
        return None
    try:
        at, _, key = base64.urlsafe_b64decode(value.encode() + b"==").decode().partition("|")
        when = parse_time("cursor", at)
        if when is None:
            raise ValueError("no time")
        return when, uuid.UUID(key)
    except (ContractError, ValueError, binascii.Error, UnicodeDecodeError) as exc:
        raise ContractError("cursor is not one this API gave out",
                            code="invalid_cursor") from exc


async def list_batches(request: web.Request) -> web.Response:
    caller = await tenant(request)
    state = request.query.get("state")
    if state is not None and state not in _STATES:
        raise ContractError(f"state is one of {', '.join(_STATES)}", code="invalid_query")
    page_size = limit(request.query, default=50)
    after = _decode_cursor(request.query.get("cursor"))
    # Read from the tenant's own shares of batches (batch_tenants), a page at a time, like
    # the other lists: never a walk over every tenant's batches to find its own.
    with request.app[GATES].hold("read", caller.id):
        rows = await request.app[STORE].batches.overview(
            state=state, tenant_id=caller.id, limit=page_size + 1, after=after)
    page, more = rows[:page_size], len(rows) > page_size
    next_cursor = _encode_cursor(page[-1].created_at, page[-1].key) if more else None
    return web.json_response({"batches": [r.as_dict() for r in page],
                              "next_cursor": next_cursor})


async def show_batch(request: web.Request) -> web.Response:
    found, tenant_id = await _found(request)
    members = await request.app[STORE].batches.members(found.key, tenant_id=tenant_id)
    return web.json_response({**found.as_dict(), "jobs": [m.as_dict() for m in members]})


async def cancel_batch(request: web.Request) -> web.Response:
    found, tenant_id = await _found(request)
    store = request.app[STORE]
    mine = await store.batches.members(found.key, tenant_id=tenant_id,
                                       limit=found.request_count + 1)
    if found.others:
        raise ContractError("the batch also holds other tenants' jobs: cancel your jobs "
                            "instead (POST /v1/jobs/{id}/cancel)", code="batch_shared",
                            status=409)
    if not await store.batches.request_cancel(found.key):
        raise ContractError(f"the batch is {found.state}: nothing to cancel",
                            code="batch_closed", status=409)
    again = await store.batches.find(str(found.key), tenant_id=tenant_id)
    assert again is not None
    return web.json_response({**again.as_dict(), "jobs": [m.as_dict() for m in mine]},
                             status=202)


ROUTES = [
    Route("GET", "/v1/batches", list_batches, {
        "operationId": "listBatches",
        "parameters": [query("state", {"type": "string", "enum": list(_STATES)}), LIMIT,
                       query("cursor", {"type": "string"})],
        "responses": {"200": answer("provider batches holding the tenant's jobs, newest "
                                    "first, a page at a time (next_cursor)", BatchList),
                      **problems(400, 401, 429)},
    }),
    Route("GET", "/v1/batches/{batch_id}", show_batch, {
        "operationId": "getBatch", "parameters": [BATCH_ID],
        "responses": {"200": answer("the batch and the tenant's jobs in it", BatchDetail),
                      **problems(401, 404, 429)},
    }),
    Route("POST", "/v1/batches/{batch_id}/cancel", cancel_batch, {
        "operationId": "cancelBatch", "parameters": [BATCH_ID],
        "responses": {"202": answer("cancel requested: the poller cancels it at the "
                                    "provider; unfinished jobs go into a new batch",
                                    BatchDetail), **problems(401, 404, 409, 429)},
    }),
]
