"""Reviews: the queue, one review (input, output, the correction form) and its decision."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from aiohttp import web

from calmq.errors import ContractError
from calmq.producers.console.forms import optional
from calmq.producers.console.reads import ConsoleData, Review
from calmq.producers.console.session import Page, guard, redirect
from calmq.producers.console.shaping import corrections, field_text, output_fields, since
from calmq.producers.console.templates import render
from calmq.producers.console.views.common import Route, job_id
from calmq.producers.timestamps import format_time
from calmq.reviews import Decision

__all__ = ["ROUTES"]


@guard("review")
async def reviews_json(request: web.Request, page: Page) -> web.StreamResponse:
    rows = await ConsoleData.of(request).reviews(page.scope)
    return web.json_response({"reviews": [
        {"job_id": str(r.id), "tenant": r.tenant, "workflow": r.workflow, "step": r.step,
         "confidence": r.confidence, "requested_at": format_time(r.updated_at),
         "deadline_at": format_time(r.review_deadline_at)} for r in rows]})


@guard("review")
async def reviews_page(request: web.Request, page: Page) -> web.StreamResponse:
    rows = await ConsoleData.of(request).reviews(page.scope)
    now = datetime.now(UTC)
    done = request.query.get("done", "")
    return render("reviews.html", title="Review queue", page=page, current="reviews",
                  rows=[(r, since(r.review_deadline_at, now)) for r in rows],
                  notice=f"Review {done}." if done in ("approved", "rejected") else "")


def _fields(data: ConsoleData, review: Review) -> list[tuple[str, str, Any, bool]]:
    workflow = data.workflow(review.workflow)
    model = workflow.step(review.step).output_model if workflow is not None else None
    return output_fields(model, review.output)


async def _review_form(request: web.Request, page: Page, review: Review, error: str = "",
                       status: int = 200) -> web.StreamResponse:
    data = ConsoleData.of(request)
    left = since(review.review_deadline_at)
    input_preview = None
    if review.input_preview is None and review.input_ref and data.owns(review,
                                                                         review.input_ref):
        input_preview = await data.preview(review.input_ref, None)
    return render(
        "review.html", status, title=f"Review {review.id}", page=page,
        current="reviews", review=review, error=error, input_preview=input_preview,
        left=None if left is None else ("overdue" if left < 0 else left),
        fields=[(name, kind, field_text(kind, value), value, required)
                for name, kind, value, required in _fields(data, review)])


@guard("review")
async def review_page(request: web.Request, page: Page) -> web.StreamResponse:
    review = await ConsoleData.of(request).review(page.scope, job_id(request))
    return await _review_form(request, page, review)


@guard("review")
async def decide(request: web.Request, page: Page) -> web.StreamResponse:
    data = ConsoleData.of(request)
    form = await request.post()
    review = await data.review(page.scope, job_id(request))
    choice = str(form.get("decision", ""))
    if choice not in ("approve", "reject"):
        raise ContractError("decision is approve or reject", code="invalid_form", status=422)
    changed: dict[str, Any] = {}
    try:
        if choice == "approve":
            changed = corrections(_fields(data, review), form)
        reason = optional(form, "reason", label="the reason")
    except ContractError as exc:
        return await _review_form(request, page, review, exc.message, 422)
    if choice == "reject" and reason is None:
        return await _review_form(request, page, review, "a rejection needs a reason", 422)
    try:
        await data.decide(review, Decision(choice, page.identity, changed, reason))  # type: ignore[arg-type]
    except ContractError as exc:
        if exc.code != "invalid_fields":
            raise
        # The same form again, with the API's invalid_fields message and status.
        return await _review_form(request, page, review, exc.message, 422)
    # On to the next review in the queue, the way a reviewer works through it.
    rest = await data.reviews(page.scope, limit=1)
    done = "approved" if choice == "approve" else "rejected"
    if rest:
        return redirect(f"/console/reviews/{rest[0].id}?done={done}")
    return redirect(f"/console/reviews?done={done}")


ROUTES: tuple[Route, ...] = (
    ("GET", "/console/reviews", reviews_page),
    ("GET", "/console/reviews.json", reviews_json),
    ("GET", "/console/reviews/{job_id}", review_page),
    ("POST", "/console/reviews/{job_id}", decide),
)
