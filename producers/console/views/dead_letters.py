"""Dead letters: grouped by class and code (with live counts), one group's jobs, and the
confirmed redrive."""

from __future__ import annotations

import uuid
from typing import Any
from urllib.parse import urlencode

from aiohttp import web

from calmq.errors import ContractError
from calmq.producers.console.forms import optional
from calmq.producers.console.reads import ConsoleData, DeadLetterGroup
from calmq.producers.console.session import Page, guard, redirect
from calmq.producers.console.templates import fragment, render
from calmq.producers.console.views.common import Route
from calmq.producers.timestamps import format_time

__all__ = ["ROUTES"]


def _key(g: DeadLetterGroup) -> str:
    return f"{g.workflow}|{g.step}|{g.failure_class}|{g.code}"


def _groups(groups: list[DeadLetterGroup], kept: list[str]) -> list[dict[str, Any]]:
    """The groups' rows; a group the page showed (``kept``) that has emptied since stays,
    with a count of 0, until the page is reloaded (its row does not vanish under a
    person's eyes)."""
    rows = [{"key": _key(g), "failure_class": g.failure_class, "code": g.code,
             "workflow": g.workflow, "step": g.step, "count": g.count, "oldest": g.oldest,
             "newest": g.newest,
             "url": "/console/dead-letters/group?" + urlencode(
                 {"workflow": g.workflow, "step": g.step,
                  "failure_class": g.failure_class or "", "code": g.code or ""})}
            for g in groups]
    present = {r["key"] for r in rows}
    for key in kept:
        parts = key.split("|")
        if key in present or len(parts) != 4:
            continue
        workflow, step, failure_class, code = parts
        rows.append({"key": key, "failure_class": failure_class, "code": code,
                     "workflow": workflow, "step": step, "count": 0, "oldest": None,
                     "newest": None, "url": None})
    return rows


@guard("operate")
async def dead_letters_json(request: web.Request, page: Page) -> web.StreamResponse:
    groups = await ConsoleData.of(request).dead_letter_groups(page.scope)
    return web.json_response({"groups": [
        {"workflow": g.workflow, "step": g.step, "failure_class": g.failure_class,
         "code": g.code, "count": g.count, "first_seen": format_time(g.oldest),
         "last_seen": format_time(g.newest)} for g in groups]})


@guard("operate")
async def dead_letters_page(request: web.Request, page: Page) -> web.StreamResponse:
    groups = await ConsoleData.of(request).dead_letter_groups(page.scope)
    done = request.query.get("done", "")
    return render("dead_letters.html", title="Dead letters", page=page,
                  current="dead-letters", groups=_groups(groups, []),
                  notice=f"{done} job(s) redriven." if done.isdigit() else "")


@guard("operate")
async def dead_letters_rows(request: web.Request, page: Page) -> web.StreamResponse:
    """The groups table as the page renders it, for its live refresh (``keep``: the groups
    the page shows)."""
    groups = await ConsoleData.of(request).dead_letter_groups(page.scope)
    return fragment("_dead_letter_groups.html",
                    groups=_groups(groups, request.query.getall("keep", [])[:200]))


@guard("operate")
async def dead_letter_group(request: web.Request, page: Page) -> web.StreamResponse:
    params = request.query
    rows = await ConsoleData.of(request).dead_letters(
        page.scope, workflow=params.get("workflow") or None, step=params.get("step") or None,
        failure_class=params.get("failure_class") or None, code=params.get("code") or None)
    title = (f"{params.get('failure_class') or '?'} / {params.get('code') or '?'} in "
             f"{params.get('workflow') or 'any workflow'}")
    return render("dead_letter_group.html", title="Dead-letter group", page=page,
                  current="dead-letters", rows=rows, group=title)


@guard("operate")
async def redrive(request: web.Request, page: Page) -> web.StreamResponse:
    form = await request.post()
    try:
        ids = list(dict.fromkeys(uuid.UUID(str(v)) for v in form.getall("job_id", [])))
    except ValueError as exc:
        raise ContractError("a job_id is not a job id", code="invalid_form", status=422) from exc
    reason = optional(form, "reason", label="the reason")
    if not ids:
        raise ContractError("select at least one dead letter", code="invalid_form", status=422)
    if reason is None:
        raise ContractError("a redrive needs a reason", code="redrive_needs_reason", status=422)
    if form.get("confirm") != "yes":
        return render("redrive_confirm.html", title="Confirm the redrive", page=page,
                      current="dead-letters", ids=ids, reason=reason)
    outcomes = await ConsoleData.of(request).redrive(ids, by=page.identity, reason=reason,
                                                     scope=page.scope)
    redriven = sum(1 for o in outcomes if o.outcome == "redriven")
    others = [o for o in outcomes if o.outcome != "redriven"]
    if others:
        return render("redrive_result.html", 409, title="Redrive", page=page,
                      current="dead-letters", redriven=redriven,
                      others=[[str(o.job_id), o.outcome, o.code, o.message] for o in others])
    if len(ids) == 1:
        return redirect(f"/console/jobs/{ids[0]}")
    return redirect(f"/console/dead-letters?done={redriven}")


ROUTES: tuple[Route, ...] = (
    ("GET", "/console/dead-letters", dead_letters_page),
    ("GET", "/console/dead-letters/rows", dead_letters_rows),
    ("GET", "/console/dead-letters.json", dead_letters_json),
    ("GET", "/console/dead-letters/group", dead_letter_group),
    ("POST", "/console/dead-letters/redrive", redrive),
)
