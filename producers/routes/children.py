"""A job's child jobs (issue 43, calmq.data.children): GET /v1/jobs/{id}/children, a page of
the children a step of the job started, in input order, with their counts by status and the
job's joins. A child is an ordinary job: GET /v1/jobs/{child id} shows it whole (and its
``parent_id``)."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from calmq.data.children import ChildView
from calmq.errors import ContractError, NotFound
from calmq.producers.auth import tenant
from calmq.producers.context import GATES, STORE
from calmq.producers.models import ChildPage
from calmq.producers.parsing import job_id, limit
from calmq.producers.routing import JOB_ID, LIMIT, Route, answer, problems, query
from calmq.producers.timestamps import format_time
from calmq.producers.views import public_error

__all__ = ["ROUTES"]

_PARAMS = frozenset({"limit", "cursor"})


def _after(cursor: str | None) -> int:
    """The last child index of the previous page (the cursor); -1: from the first."""
    if cursor is None:
        return -1
    try:
        after = int(cursor)
    except ValueError:
        after = -2
    if after < -1:
        raise ContractError("cursor is the next_cursor of a previous page", code="invalid_query")
    return after


def child_view(child: ChildView) -> dict[str, Any]:
    """``models.ChildView`` of a child."""
    return {"job_id": str(child.id), "index": child.index, "workflow": child.workflow,
            "status": child.status, "attempt": child.attempt, "step": child.step,
            "artifact": child.artifact, "error": public_error(child.error),
            "created_at": format_time(child.created_at),
            "updated_at": format_time(child.updated_at)}


async def list_children(request: web.Request) -> web.Response:
    caller = await tenant(request)
    params = request.query
    unknown = sorted(set(params) - _PARAMS)
    if unknown:
        raise ContractError(f"unknown query parameter(s) {', '.join(unknown)}",
                            code="invalid_query")
    page_size = limit(params, default=100)
    after = _after(params.get("cursor"))
    ident = job_id(request)
    store = request.app[STORE]
    with request.app[GATES].hold("read", caller.id):
        if await store.jobs.view(caller.id, ident) is None:
            raise NotFound("no such job")
        summary = await store.children.summary(caller.id, ident)
        rows = await store.children.page(caller.id, ident, after=after, limit=page_size + 1)
    page, more = rows[:page_size], len(rows) > page_size
    return web.json_response({
        "job_id": str(ident),
        "parent_id": str(summary.parent_id) if summary.parent_id else None,
        "counts": summary.counts, "total": summary.total,
        "joins": summary.joins,
        "children": [child_view(c) for c in page],
        "next_cursor": str(page[-1].index) if more else None})


ROUTES = [
    Route("GET", "/v1/jobs/{job_id}/children", list_children, {
        "operationId": "listChildren",
        "description": "The child jobs a step of this job started (ctx.spawn), in input "
                       "order, paginated by cursor; with the children counted by status, "
                       "the job's joins and its own parent_id (docs/how-to/fan-out.md).",
        "parameters": [JOB_ID, LIMIT, query("cursor", {"type": "string"})],
        "responses": {"200": answer("a page of the job's children", ChildPage),
                      **problems(400, 401, 404, 429)},
    }),
]
