"""What the views share: the route type, a job id from the path, redirects."""

from __future__ import annotations

import uuid
from collections.abc import Awaitable, Callable

from aiohttp import web

from calmq.errors import NotFound

__all__ = ["UUID", "Route", "job_id"]

Route = tuple[str, str, Callable[[web.Request], Awaitable[web.StreamResponse]]]
UUID = "[0-9a-fA-F-]{36}"


def job_id(request: web.Request) -> uuid.UUID:
    try:
        return uuid.UUID(request.match_info["job_id"])
    except ValueError as exc:
        raise NotFound("no such job") from exc
