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
from calmq.producers.context import AUTH_CACHE, AUTH_MISSES, RATE, SETTINGS, STORE

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
    # After the lookup: a bucket per real key (random keys would each get a fresh one).
    request.app[RATE].check(found.identity)
    if roles and not any(found.can(r) for r in roles):
        raise ContractError(f"this API key has the role(s) {', '.join(found.roles)}; this "
                            f"needs {' or '.join(roles)} (calmq tenants add-key --roles)",
                            code="role_forbidden", status=403)
    return found


async def key_tenant(request: web.Request, key: str) -> Tenant | None:
    """The tenant of ``key`` through the cache, or None (unknown or revoked)."""
    cache, misses = request.app[AUTH_CACHE], request.app[AUTH_MISSES]
    now = time.monotonic()
    hit = cache.get(key)
    if hit is not None and hit[0] > now:
        return hit[1]
    missed = misses.get(key)
    if missed is not None and missed > now:
        return None
    found = await request.app[STORE].tenants.for_key(key)
    settings = request.app[SETTINGS]
    expires = now + settings.auth_cache_seconds
    if found is None:
        # Unknown keys apart, the oldest forgotten first: random keys cannot evict the
        # known ones (they used to fill the one cache until it was cleared whole).
        misses.pop(key, None)
        if settings.auth_cache_max_misses:
            misses[key] = expires
            while len(misses) > settings.auth_cache_max_misses:
                misses.popitem(last=False)
        return None
    if len(cache) > _CACHE_MAX:
        cache.clear()  # only known keys are here: this many means keys were rotated a lot
    cache[key] = (expires, found)
    return found
