"""The web console under /console: server-rendered pages for reviewers and operators.

Served by the API process (build_app adds these routes), so it needs no process, build step
or CDN of its own: the HTML is built in producers.console.pages, the few assets (one CSS
and one script) are package data in static/. The routes are not in producers.routes.ROUTES
on purpose: they are pages, not the API's contract, so /openapi.json does not list them.
docs/how-to/console.md describes the pages; docs/reference/console.md the routes and roles.
"""

from __future__ import annotations

from aiohttp import web

__all__ = ["CONSUMER_LAG", "add_console"]

# The overview's consumer-lag reader (producers.console.lag): one per application, so page
# views share its cached answer.
CONSUMER_LAG = web.AppKey("console_consumer_lag", object)


def add_console(app: web.Application) -> None:
    """Register the console's routes on the API application."""
    from calmq.producers.console.lag import FleetLag
    from calmq.producers.console.pages import HANDLERS

    app[CONSUMER_LAG] = FleetLag()

    for method, path, handler in HANDLERS:
        app.router.add_route(method, path, handler)
