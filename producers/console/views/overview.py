"""The overview: backlog and queue age, throughput, reviews against their caps, tokens and
cost against the budget; for a platform key, the relay's slots and consumer lag."""

from __future__ import annotations

from datetime import UTC, datetime

from aiohttp import web

from calmq.errors import ContractError
from calmq.producers.console.forms import optional, text
from calmq.producers.console.reads import ConsoleData
from calmq.producers.console.session import Page, guard, redirect
from calmq.producers.console.shaping import lag_view
from calmq.producers.console.templates import render
from calmq.producers.console.views.common import Route

__all__ = ["ROUTES"]


@guard()
async def overview(request: web.Request, page: Page) -> web.StreamResponse:
    data = ConsoleData.of(request)
    view = await data.overview(page.scope)
    slots = lag = None
    if page.platform:  # fleet-wide: platform keys only
        slots = [[s.slot, "yes" if s.active else "no", f"{s.retained_bytes:,}"]
                 for s in await data.slots()]
        lag = lag_view(await data.consumer_lag())
    return render("overview.html", title="Overview", page=page, current="overview",
                  view=view, slots=slots, lag=lag, platform_view=page.platform,
                  set_caps=page.platform and page.can("operate"), now=datetime.now(UTC))


@guard("operate")
async def set_review_cap(request: web.Request, page: Page) -> web.StreamResponse:
    if not page.platform:
        raise ContractError("review caps are fleet-wide: set them with a platform key",
                            code="platform_key_required", status=403)
    form = await request.post()
    pool = text(form, "pool", label="the pool")
    raw = optional(form, "cap", label="the cap")
    if not pool:
        raise ContractError("name the pool", code="invalid_form", status=422)
    try:
        cap = int(raw) if raw else None
    except ValueError as exc:
        raise ContractError("the cap is a whole number", code="invalid_form", status=422) from exc
    if cap is not None and cap < 1:
        raise ContractError("the cap is at least 1 (empty: no cap)", code="invalid_form",
                            status=422)
    await ConsoleData.of(request).set_review_cap(pool, cap, page.identity)
    return redirect("/console/overview")


ROUTES: tuple[Route, ...] = (
    ("GET", "/console/overview", overview),
    ("POST", "/console/review-caps", set_review_cap),
)
