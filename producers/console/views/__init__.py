"""The console's views, one module per resource: the sign-in, the overview, jobs, reviews,
dead letters and the static assets. A view reads through producers.console.reads, shapes
with producers.console.shaping and answers a template; it imports no data layer and no
SQL (a contract of `make lint`)."""

from __future__ import annotations

from calmq.producers.console.views import account, assets, dead_letters, jobs, overview, reviews
from calmq.producers.console.views.common import Route

__all__ = ["ROUTES", "Route"]

ROUTES: tuple[Route, ...] = (*account.ROUTES, *overview.ROUTES, *jobs.ROUTES, *reviews.ROUTES,
                             *dead_letters.ROUTES, *assets.ROUTES)
