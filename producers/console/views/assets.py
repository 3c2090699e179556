"""The console's two static files (package data: no CDN, no build step)."""

from __future__ import annotations

from importlib import resources

from aiohttp import web

from calmq.errors import NotFound
from calmq.producers.console.views.common import Route

__all__ = ["ROUTES"]

_TYPES = {".css": "text/css", ".js": "text/javascript"}


async def static(request: web.Request) -> web.StreamResponse:
    name = request.match_info["name"]
    suffix = name[name.rfind("."):] if "." in name else ""
    if "/" in name or suffix not in _TYPES:
        raise NotFound("no such file", code="no_route")
    entry = resources.files("calmq.producers.console").joinpath("static", name)
    if not entry.is_file():
        raise NotFound("no such file", code="no_route")
    return web.Response(body=entry.read_bytes(), content_type=_TYPES[suffix],
                        headers={"Cache-Control": "max-age=300"})


ROUTES: tuple[Route, ...] = (("GET", "/console/static/{name}", static),)
