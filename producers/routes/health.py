"""Operations: liveness, readiness (PostgreSQL answers) and Prometheus metrics. No API key."""

from __future__ import annotations

import logging

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from calmq.producers.context import SETTINGS, STORE
from calmq.producers.problems import problem
from calmq.producers.routing import PUBLIC, Route, problems

__all__ = ["ROUTES"]

log = logging.getLogger(__name__)


async def healthz(_request: web.Request) -> web.Response:
    return web.json_response({"ok": True})


async def readyz(request: web.Request) -> web.Response:
    try:
        await request.app[STORE].jobs.ping()
    except Exception:  # any failure means not ready
        # The driver's text stays in the log: it names hosts, users and server messages.
        log.warning("readiness check: PostgreSQL does not answer", exc_info=True)
        return problem(503, "database_unavailable", "PostgreSQL does not answer",
                       base=request.app[SETTINGS].api_problem_base_url)
    return web.json_response({"ok": True})


async def metrics(_request: web.Request) -> web.Response:
    return web.Response(body=generate_latest(), headers={"Content-Type": CONTENT_TYPE_LATEST})


ROUTES = [
    Route("GET", "/healthz", healthz, {
        "operationId": "healthz", **PUBLIC, "responses": {"200": {"description": "alive"}}}),
    Route("GET", "/readyz", readyz, {
        "operationId": "readyz", **PUBLIC,
        "responses": {"200": {"description": "ready"}, **problems(503)}}),
    Route("GET", "/metrics", metrics, {
        "operationId": "metrics", **PUBLIC,
        "responses": {"200": {"description": "Prometheus text"}}}),
]
