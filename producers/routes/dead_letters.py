"""Dead letters over HTTP: list the tenant's dead-lettered jobs, redrive one (calmq.deadletters)."""

from __future__ import annotations

from aiohttp import web

from calmq.deadletters import DeadLetterFilter, DeadLetters
from calmq.errors import ContractError
from calmq.limits import check_note
from calmq.producers.auth import tenant
from calmq.producers.context import GATES, OBJECTS, SETTINGS, STORE, WORKFLOWS
from calmq.producers.models import DeadLetterList, Redriven, RedriveRequest
from calmq.producers.parsing import job_id, limit, read_body
from calmq.producers.routing import JOB_ID, LIMIT, Route, answer, json_body, problems, query
from calmq.producers.timestamps import parse_time
from calmq.producers.views import dead_letter_item, job_view

__all__ = ["ROUTES"]


async def list_dead_letters(request: web.Request) -> web.Response:
    caller = await tenant(request, "operate")
    params = request.query
    # since/until: a time without a zone is read in the database's zone; a bad one is 422.
    where = DeadLetterFilter(
        tenant_id=caller.id, failure_class=params.get("failure_class"),
        code=params.get("code"), workflow=params.get("workflow"),
        since=parse_time("since", params.get("since"), zone_required=False, status=422),
        until=parse_time("until", params.get("until"), zone_required=False, status=422),
        limit=limit(params, default=100))
    with request.app[GATES].hold("read", caller.id):
        rows = await DeadLetters(request.app[STORE],
                                 workflows=request.app[WORKFLOWS]).find(where)
    return web.json_response({"dead_letters": [dead_letter_item(r) for r in rows]})


async def redrive_dead_letter(request: web.Request) -> web.Response:
    caller = await tenant(request, "operate")
    ident = job_id(request)
    req, _raw = await read_body(request, RedriveRequest)
    most = request.app[SETTINGS].max_note_bytes
    check_note("reason", req.reason, most)
    check_note("by", req.by, most)
    dead = DeadLetters(request.app[STORE], workflows=request.app[WORKFLOWS],
                       objects=request.app[OBJECTS],
                       children_in_flight=request.app[SETTINGS].children_in_flight_max)
    # Who redrove is the key that called, not what the body claims (an audit field).
    [outcome] = await dead.redrive([ident], by=caller.identity, note=req.by,
                                   reason=req.reason, tenant_id=caller.id, dry_run=req.dry_run)
    if outcome.outcome == "skipped":
        raise ContractError(outcome.message, code=outcome.code or "not_dead_lettered",
                            status=409)
    if outcome.outcome == "rejected":
        raise ContractError(outcome.message, code=outcome.code or "redrive_rejected",
                            status=409 if outcome.code == "deadline_passed" else 422)
    job = await request.app[STORE].jobs.view(caller.id, ident)
    assert job is not None
    return web.json_response({**job_view(job), "redrive": outcome.as_dict()})


ROUTES = [
    Route("GET", "/v1/dead-letters", list_dead_letters, {
        "operationId": "listDeadLetters",
        "parameters": [
            *(query(n, {"type": "string"}) for n in ("failure_class", "code", "workflow")),
            *(query(n, {"type": "string", "format": "date-time"}) for n in ("since", "until")),
            LIMIT],
        "responses": {"200": answer("dead-lettered jobs, oldest death first", DeadLetterList),
                      **problems(401, 403, 422, 429)},
    }),
    Route("POST", "/v1/dead-letters/{job_id}/redrive", redrive_dead_letter, {
        "operationId": "redriveDeadLetter", "parameters": [JOB_ID],
        "requestBody": json_body(RedriveRequest),
        "responses": {"200": answer("requeued (or, with dry_run, unchanged)", Redriven),
                      **problems(400, 401, 403, 404, 409, 415, 422, 429)},
    }),
]
