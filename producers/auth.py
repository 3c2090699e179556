"""Who is calling: the tenant of a request's bearer API key, cached for a few seconds.

The cache keeps a database round trip off every accept; a revoked key still stops working
at once because build_app clears the cache on the key-change notification.

A key has roles (submit, review, operate; calmq.data.tenants.ROLES): a route names the ones
that may call it and another key answers 403 ``role_forbidden``. The console's sign-in
cookie (HttpOnly, SameSite=Strict) holds the key too; it is accepted for reading only
(GET/HEAD), so the console's pages can follow a job over the API's SSE, and a cross-site
form can never act with it.
"""

from __future__ import annotations

import time

from aiohttp import web

from calmq.data import Tenant
from calmq.errors import ContractError
from calmq.producers.context import AUTH_CACHE, SETTINGS, STORE

__all__ = ["COOKIE", "key_tenant", "tenant"]

_CACHE_MAX = 10_000
# The console's sign-in cookie: the API key itself (producers/console).
COOKIE = "calmq_console"


async def tenant(request: web.Request, *roles: str) -> Tenant:
    """The caller's tenant; ContractError 401 for a missing, unknown or revoked key, 403
    when ``roles`` are given and the key has none of them."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if not header and request.method in ("GET", "HEAD") and request.cookies.get(COOKIE):
        scheme, key = "bearer", request.cookies[COOKIE]
    if scheme.lower() != "bearer" or not key.strip():
        raise ContractError("send Authorization: Bearer <api key>", code="missing_api_key",
                            status=401)
    found = await key_tenant(request, key.strip())
    if found is None:
        raise ContractError("the API key is unknown or revoked", code="invalid_api_key",
                            status=401)
    if roles and not any(found.can(r) for r in roles):
        raise ContractError(f"this API key has the role(s) {', '.join(found.roles)}; this "
                            f"needs {' or '.join(roles)} (calmq tenants add-key --roles)",
                            code="role_forbidden", status=403)
    return found


async def key_tenant(request: web.Request, key: str) -> Tenant | None:
    """The tenant of ``key`` through the cache, or None (unknown or revoked)."""
    cache = request.app[AUTH_CACHE]
    now = time.monotonic()
    hit = cache.get(key)
    if hit is not None and hit[0] > now:
        found = hit[1]
    else:
        found = await request.app[STORE].tenants.for_key(key)
        if len(cache) > _CACHE_MAX:
            cache.clear()
        cache[key] = (now + request.app[SETTINGS].auth_cache_seconds, found)
    return found
