"""GET /openapi.json: the document producers.openapi generated when the app was built."""

from __future__ import annotations

from aiohttp import web

from calmq.producers.context import OPENAPI
from calmq.producers.routing import PUBLIC, Route

__all__ = ["ROUTES"]


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(request.app[OPENAPI])


ROUTES = [
    Route("GET", "/openapi.json", openapi, {
        "operationId": "openapi", **PUBLIC,
        "responses": {"200": {"description": "this document"}}}),
]
