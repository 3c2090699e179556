"""RFC 9457 problem details: every API error is application/problem+json with a stable code."""

from __future__ import annotations

import json
from typing import Any

from aiohttp import web

__all__ = ["problem"]

_TITLES = {
    400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 409: "Conflict", 413: "Content Too Large",
    415: "Unsupported Media Type", 422: "Unprocessable Content", 429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def problem(status: int, code: str, detail: str, **extra: Any) -> web.Response:
    body = {
        "type": f"https://calmq.dev/problems/{code}",
        "title": _TITLES.get(status, "Error"),
        "status": status,
        "detail": detail,
        "code": code,
        **extra,
    }
    return web.Response(
        status=status, text=json.dumps(body), content_type="application/problem+json"
    )
