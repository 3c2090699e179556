"""The review desk over HTTP: decide on a job awaiting review, list what waits (calmq.reviews)."""

from __future__ import annotations

from aiohttp import web

from calmq.limits import check_note
from calmq.producers.auth import tenant
from calmq.producers.context import GATES, OBJECTS, SETTINGS, STORE, WORKFLOWS
from calmq.producers.models import JobView, ReviewList, ReviewRequest
from calmq.producers.parsing import job_id, limit, read_body
from calmq.producers.routing import JOB_ID, LIMIT, Route, answer, json_body, problems
from calmq.producers.views import job_view, review_item
from calmq.reviews import Decision, ReviewDesk

__all__ = ["ROUTES"]


def _desk(request: web.Request) -> ReviewDesk:
    return ReviewDesk(request.app[STORE], request.app[WORKFLOWS], request.app[OBJECTS])


async def review_job(request: web.Request) -> web.Response:
    caller = await tenant(request, "review")
    ident = job_id(request)
    req, _raw = await read_body(request, ReviewRequest)
    most = request.app[SETTINGS].max_note_bytes
    check_note("reason", req.reason, most)
    check_note("reviewer", req.reviewer, most)
    await _desk(request).decide(caller.id, ident,
                                Decision(req.decision, caller.identity, req.fields, req.reason,
                                         note=req.reviewer))
    job = await request.app[STORE].jobs.view(caller.id, ident)
    assert job is not None
    return web.json_response(job_view(job))


async def list_reviews(request: web.Request) -> web.Response:
    caller = await tenant(request, "review")
    with request.app[GATES].hold("read", caller.id):
        rows = await _desk(request).pending(caller.id,
                                            limit=limit(request.query, default=100))
    return web.json_response({"reviews": [review_item(r) for r in rows]})


ROUTES = [
    Route("POST", "/v1/jobs/{job_id}/review", review_job, {
        "operationId": "reviewJob", "parameters": [JOB_ID],
        "requestBody": json_body(ReviewRequest),
        "responses": {"200": answer("decided", JobView),
                      **problems(400, 401, 403, 404, 409, 415, 422, 429)},
    }),
    Route("GET", "/v1/reviews", list_reviews, {
        "operationId": "listReviews", "parameters": [LIMIT],
        "responses": {"200": answer("jobs awaiting review, oldest first", ReviewList),
                      **problems(401, 403, 422, 429)},
    }),
]
