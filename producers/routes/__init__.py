"""The API's routes by resource; ``ROUTES`` is the whole table, in registration order.

build_app registers exactly this table and producers.openapi documents exactly it, so the
served routes and the documented paths cannot drift apart.
"""

from __future__ import annotations

from calmq.producers.routes import (
    batches,
    bulk,
    dead_letters,
    docs,
    health,
    jobs,
    reviews,
    workflows,
)
from calmq.producers.routes.children import ROUTES as CHILDREN_ROUTES
from calmq.producers.routes.reruns import ROUTES as RERUN_ROUTES
from calmq.producers.routing import Route

__all__ = ["ROUTES"]

ROUTES: tuple[Route, ...] = (
    *bulk.ROUTES, *jobs.ROUTES, *workflows.ROUTES, *reviews.ROUTES, *dead_letters.ROUTES,
    *health.ROUTES, *batches.ROUTES, *RERUN_ROUTES, *CHILDREN_ROUTES, *docs.ROUTES)
