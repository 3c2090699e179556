"""RFC 9457 problem details: every API error is application/problem+json with a stable code.

What a tenant reads of an error (a problem's detail, a job's error message and the
messages in its history) names no internal host: a driver's or client library's text
("Cannot connect to host llm-gw.internal:8443", "connection to server at \"db-1\"
(10.0.0.5), port 5432 failed") says where calmq's parts run. ``hide_hosts`` replaces
URLs, host:port pairs, IP addresses and quoted server names with ``<internal>``; the
whole text stays in the logs and in the job's row (``calmq dlq show`` prints it).
"""

from __future__ import annotations

import json
import re
from typing import Any

from aiohttp import web

from calmq.settings import PROBLEM_BASE_URL

__all__ = ["hide_hosts", "problem", "problem_type"]

_HIDDEN = "<internal>"
_HOSTS = re.compile(
    r"""
      \b[a-z][a-z0-9+.-]*://[^\s'"<>]+                      # a URL (credentials and all)
    | \[[0-9a-f:.]*:[0-9a-f:.]*\](?::\d{1,5})?            # [IPv6]:port
    | \b\d{1,3}(?:\.\d{1,3}){3}(?::\d{1,5})?\b            # IPv4[:port]
    | \b(?:[a-z0-9-]+\.)*[a-z0-9-]*[a-z][a-z0-9-]*:\d{1,5}\b # host:port
    | (?<=\bserver\ at\ )"[^"]*"                          # libpq: server at "db-1"
    | (?<=\bhost\ )"[^"]*"                                # host "db-1"
    | (?<=\bhost=)[^\s,;)]+                                # host=db-1
    """,
    re.IGNORECASE | re.VERBOSE,
)


def hide_hosts(text: str) -> str:
    """``text`` with every URL, host:port, IP address and quoted server name replaced by
    ``<internal>``."""
    return _HOSTS.sub(_HIDDEN, text)

_TITLES = {
    400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found",
    405: "Method Not Allowed", 409: "Conflict", 413: "Content Too Large",
    415: "Unsupported Media Type", 422: "Unprocessable Content", 429: "Too Many Requests",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


def problem_type(code: str, base: str = PROBLEM_BASE_URL) -> str:
    """The ``type`` URI of ``code``: its anchor under ``base`` (a URL ending in ``#``)."""
    return f"{base}{code}"


def problem(status: int, code: str, detail: str, *, base: str = PROBLEM_BASE_URL,
            **extra: Any) -> web.Response:
    body = {
        "type": problem_type(code, base),
        "title": _TITLES.get(status, "Error"),
        "status": status,
        "detail": hide_hosts(detail),
        "code": code,
        **extra,
    }
    return web.Response(
        status=status, text=json.dumps(body), content_type="application/problem+json"
    )
