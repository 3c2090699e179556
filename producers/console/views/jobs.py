"""Jobs: the filtered list (and its live rows), a job's page (and its live timeline), its
input and artifact, cancelling it, and rerunning one that ended from a step."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from aiohttp import web

from calmq.errors import ContractError
from calmq.jobs import TERMINAL, EventType, Priority, Status
from calmq.producers.console.forms import storable_problem
from calmq.producers.console.reads import ConsoleData, ConsoleJob, Download, JobQuery
from calmq.producers.console.session import Page, guard, redirect
from calmq.producers.console.shaping import (
    attempt_rows,
    held_for_review_cap,
    trace_id,
    waiting_notice,
)
from calmq.producers.console.templates import fragment, render
from calmq.producers.console.views.common import UUID, Route, job_id
from calmq.producers.timestamps import format_time, parse_time

__all__ = ["ROUTES"]

_STATUSES = [s.value for s in Status]
_PRIORITIES = tuple(p.value for p in Priority)
_LANES = ("online", "batch")
LIST_LIMIT = 100


def _query(request: web.Request, page: Page) -> JobQuery:
    params = request.query
    statuses = [s for s in params.getall("status", []) if s] or None
    if statuses and not set(statuses) <= set(_STATUSES):
        raise ContractError(f"status is one of {', '.join(_STATUSES)}", code="invalid_query")

    def text(name: str) -> str | None:
        value = params.get(name, "").strip()
        problem = storable_problem(value)
        if problem:  # PostgreSQL would refuse it: a clear answer instead of a 500
            raise ContractError(f"{name} {problem}", code="invalid_query")
        return value or None

    def at(name: str) -> datetime | None:
        value = text(name)
        return parse_time(name, value, zone_required=False) if value else None

    return JobQuery(tenant_id=page.scope, statuses=statuses, workflow=text("workflow"),
                    pool=text("pool"), priority=text("priority"), lane=text("lane"),
                    created_after=at("created_after"), created_before=at("created_before"),
                    search=text("q"), limit=LIST_LIMIT)


def _table(request: web.Request, page: Page, rows: list[ConsoleJob]) -> dict[str, Any]:
    """What the jobs table's template needs (the page and its live rows alike)."""
    return {"rows": rows, "platform": page.platform,
            "live": f"/console/jobs/rows?{request.query_string}"}


def _choices(known: tuple[str, ...], chosen: str | None) -> list[str]:
    return [*known, *([chosen] if chosen and chosen not in known else [])]


@guard()
async def jobs_page(request: web.Request, page: Page) -> web.StreamResponse:
    query = _query(request, page)
    data = ConsoleData.of(request)
    rows = await data.jobs(query)
    filters = {
        "statuses": _STATUSES, "chosen_statuses": query.statuses or [],
        "workflows": sorted(data.workflows), "priorities": _choices(_PRIORITIES, query.priority),
        "lanes": _choices(_LANES, query.lane), "query": query, "params": request.query}
    return render("jobs.html", title="Jobs", page=page, current="jobs", filters=filters,
                  **_table(request, page, rows))


@guard()
async def jobs_rows(request: web.Request, page: Page) -> web.StreamResponse:
    """The jobs table as the page renders it, for its live refresh."""
    rows = await ConsoleData.of(request).jobs(_query(request, page))
    return fragment("_jobs_table.html", **_table(request, page, rows))


@guard()
async def jobs_json(request: web.Request, page: Page) -> web.StreamResponse:
    rows = await ConsoleData.of(request).jobs(_query(request, page))
    return web.json_response({"jobs": [
        {"job_id": str(j.id), "tenant": j.tenant, "workflow": j.workflow, "status": j.status,
         "priority": j.priority, "lane": j.lane, "pool": j.pool, "step": j.step,
         "attempt": j.attempt, "created_at": format_time(j.created_at),
         "updated_at": format_time(j.updated_at), "metadata": j.metadata} for j in rows]})


@guard()
async def job_page(request: web.Request, page: Page) -> web.StreamResponse:
    ident = job_id(request)
    view = await ConsoleData.of(request).job_view(page.scope, ident)
    job = view.job
    return render(
        "job.html", title=f"Job {ident}", page=page, current="jobs", job=job,
        view=view, terminal=job.status in TERMINAL,
        family=await ConsoleData.of(request).family(job),
        event_types=" ".join(t.value for t in EventType),
        held_for_review_cap=job.status == "queued" and held_for_review_cap(view.events),
        wait=waiting_notice(view.events) if job.status in ("queued", "retrying") else None,
        attempts=attempt_rows(view.attempts), trace_id=trace_id(job.trace_parent),
        can_cancel=page.can("submit") or page.can("operate"),
        rerun_steps=_rerun_steps(ConsoleData.of(request), job.workflow, job.status, page))


def _rerun_steps(data: ConsoleData, name: str, status: str, page: Page) -> list[str]:
    """The steps a job that ended can be rerun from (none: it has not, or the caller may
    not submit, or its workflow is not registered here)."""
    workflow = data.workflow(name)
    if status not in TERMINAL or workflow is None or not (
            page.can("submit") or page.can("operate")):
        return []
    return [s.name for s in workflow.steps]


@guard()
async def job_timeline(request: web.Request, page: Page) -> web.StreamResponse:
    """The history entries after ``after``, as the job's page renders them, with the job's
    status: what the page appends live while the job runs."""
    try:
        after = int(request.query.get("after", "0"))
    except ValueError as exc:
        raise ContractError("after is an event id", code="invalid_query") from exc
    status, events = await ConsoleData.of(request).events_after(page.scope, job_id(request),
                                                                after)
    last = events[-1].id if events else after
    return fragment("_timeline_items.html", events=events,
                    headers={"X-Calmq-Job-Status": status, "X-Calmq-Last-Event": str(last)})


@guard()
async def job_json(request: web.Request, page: Page) -> web.StreamResponse:
    ident = job_id(request)
    data = ConsoleData.of(request)
    status, events = await data.events_after(page.scope, ident, 0)
    job = await data.job(page.scope, ident)
    return web.json_response({
        "job_id": str(ident), "tenant": job.tenant, "status": status,
        "workflow": job.workflow, "step": job.step, "artifact": job.artifact,
        "error": job.error, "events": [
            {"type": e.type, "at": format_time(e.at), "attempt": e.attempt,
             "detail": e.detail} for e in events]})


async def _send(request: web.Request, download: Download, headers: dict[str, str]
                ) -> web.StreamResponse:
    """The bytes as they are read, chunk by chunk: memory holds one chunk per download."""
    resp = web.StreamResponse(headers={"Content-Type": download.content_type,
                                       "Content-Length": str(download.size), **headers})
    await resp.prepare(request)
    async for chunk in download.chunks:
        await resp.write(chunk)
    await resp.write_eof()
    return resp


# Both downloads hold one of the job's tenant's expensive reads while they last (its read
# gate, api_reads_per_tenant, as GET /v1/jobs/{id}/artifact does): a signed-in page cannot
# run more of them at once than the API would.

@guard()
async def job_input(request: web.Request, page: Page) -> web.StreamResponse:
    ident = job_id(request)
    data = ConsoleData.of(request)
    job = await data.job(page.scope, ident)
    with data.read_gate(job.tenant_id):
        download = await data.input_download(job)
        headers = ({} if download.content_type == "application/json" else
                   {"Content-Disposition": f'attachment; filename="{ident}-input"'})
        return await _send(request, download, headers)


@guard()
async def job_artifact(request: web.Request, page: Page) -> web.StreamResponse:
    """The artifact's bytes (for a platform key too, which /v1 scopes to its own tenant)."""
    ident = job_id(request)
    data = ConsoleData.of(request)
    job = await data.job(page.scope, ident)
    with data.read_gate(job.tenant_id):
        download = await data.artifact_download(job)
        return await _send(request, download, {
            "Content-Disposition": f'attachment; filename="{ident}-artifact"'})


@guard("submit", "operate")
async def cancel(request: web.Request, page: Page) -> web.StreamResponse:
    ident = job_id(request)
    await ConsoleData.of(request).cancel(page.scope, ident, page.identity)
    return redirect(f"/console/jobs/{ident}")


@guard("submit", "operate")
async def rerun(request: web.Request, page: Page) -> web.StreamResponse:
    """Rerun the job from the chosen step: a new job, whose page the answer opens."""
    ident = job_id(request)
    form = await request.post()
    step = str(form.get("from_step", "")).strip()
    if not step:
        raise ContractError("choose the step to rerun from", code="invalid_body", status=422)
    made = await ConsoleData.of(request).rerun(page.scope, ident, step, page.identity)
    return redirect(f"/console/jobs/{made}")


ROUTES: tuple[Route, ...] = (
    ("GET", "/console/jobs", jobs_page),
    ("GET", "/console/jobs/rows", jobs_rows),
    ("GET", "/console/jobs.json", jobs_json),
    ("GET", "/console/jobs/{job_id:" + UUID + "}.json", job_json),
    ("GET", "/console/jobs/{job_id:" + UUID + "}", job_page),
    ("GET", "/console/jobs/{job_id}/timeline", job_timeline),
    ("GET", "/console/jobs/{job_id}/input", job_input),
    ("GET", "/console/jobs/{job_id}/artifact", job_artifact),
    ("POST", "/console/jobs/{job_id}/cancel", cancel),
    ("POST", "/console/jobs/{job_id}/rerun", rerun),
)
