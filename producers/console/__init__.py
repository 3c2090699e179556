"""The web console under /console: server-rendered pages for reviewers and operators.

Served by the API process (build_app adds these routes), so it needs no process, build step
or CDN of its own. Views per resource (producers.console.views) read through
producers.console.reads, shape with producers.console.shaping and render Jinja2 templates
(producers/console/templates/, autoescaped, extending base.html); the few assets (one CSS
and one script) are package data in static/. A table that refreshes live fetches its rows
rendered by the same template as the page. The routes are not in producers.routes.ROUTES
on purpose: they are pages, not the API's contract, so /openapi.json does not list them.
docs/how-to/console.md describes the pages; docs/reference/console.md the routes and roles.
"""

from __future__ import annotations

from aiohttp import web

__all__ = ["add_console"]


def add_console(app: web.Application) -> None:
    """Register the console's routes on the API application."""
    from calmq.producers.console.lag import FleetLag
    from calmq.producers.console.reads import CONSUMER_LAG
    from calmq.producers.console.views import ROUTES

    app[CONSUMER_LAG] = FleetLag()
    for method, path, handler in ROUTES:
        app.router.add_route(method, path, handler)
