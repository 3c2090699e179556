"""Who is calling: the tenant of a request's bearer API key, cached for a few seconds.

The cache keeps a database round trip off every accept; a revoked key still stops working
at once because build_app clears the cache on the key-change notification.

A key has roles (submit, review, operate; calmq.data.tenants.ROLES): a route names the ones
that may call it and another key answers 403 ``role_forbidden``. The console's sign-in
cookie (HttpOnly, SameSite=Strict) holds a session token of its own (never the key: a
session expires and is revoked on its own, ``session_tenant``); it is accepted for
reading only (GET/HEAD), so the console's pages can follow a job over the API's SSE, and a
cross-site form can never act with it. Either way the caller's key is rate limited by the
same bucket (``limit``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable

from aiohttp import web

from calmq.data import Tenant
from calmq.errors import ContractError
from calmq.producers.context import AUTH_CACHE, AUTH_MISSES, RATE, SETTINGS, STORE

__all__ = ["COOKIE", "forget_session", "key_tenant", "limit", "session_tenant", "tenant"]

_CACHE_MAX = 10_000
# The console's sign-in cookie: a session token (producers/console/session.py).
COOKIE = "calmq_console"
# Sessions share the key cache under keys no API key can be (a key has no NUL).
_SESSION = "session\0"


async def tenant(request: web.Request, *roles: str) -> Tenant:
    """The caller's tenant; ContractError 401 for a missing, unknown or revoked key, 403
    when ``roles`` are given and the key has none of them."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    found: Tenant | None
    if not header and request.method in ("GET", "HEAD") and request.cookies.get(COOKIE):
        found = await session_tenant(request, request.cookies[COOKIE])
        if found is None:
            raise ContractError("the console session has ended; sign in again",
                                code="invalid_api_key", status=401)
    else:
        if scheme.lower() != "bearer" or not key.strip():
            raise ContractError("send Authorization: Bearer <api key>",
                                code="missing_api_key", status=401)
        found = await key_tenant(request, key.strip())
        if found is None:
            raise ContractError("the API key is unknown or revoked", code="invalid_api_key",
                                status=401)
    limit(request, found)
    if roles and not any(found.can(r) for r in roles):
        raise ContractError(f"this API key has the role(s) {', '.join(found.roles)}; this "
                            f"needs {' or '.join(roles)} (calmq tenants add-key --roles)",
                            code="role_forbidden", status=403)
    return found


def limit(request: web.Request, caller: Tenant) -> None:
    """The caller's key's token bucket (Throttled, 429 ``rate_limited``, when it is empty):
    after the lookup, so there is a bucket per real key (random keys would each get a fresh
    one); a console session spends its key's bucket."""
    request.app[RATE].check(caller.identity)


async def key_tenant(request: web.Request, key: str) -> Tenant | None:
    """The tenant of ``key`` through the cache, or None (unknown or revoked)."""
    store = request.app[STORE]
    return await _cached(request, key, lambda: _forever(store.tenants.for_key(key)))


async def session_tenant(request: web.Request, token: str) -> Tenant | None:
    """The tenant of a console session token through the same cache (for no longer than
    the session has left), or None (unknown, expired, signed out, or its key revoked)."""
    if not token:
        return None
    store = request.app[STORE]

    async def lookup() -> tuple[Tenant | None, float]:
        session = await store.tenants.for_session(token)
        return (None, 0.0) if session is None else (session.tenant, session.seconds_left)

    return await _cached(request, _SESSION + token, lookup)


def forget_session(request: web.Request, token: str) -> None:
    """Drop a signed-out session from this process's cache at once (the others drop it on
    the notification the sign-out sends)."""
    request.app[AUTH_CACHE].pop(_SESSION + token, None)


async def _forever(found: Awaitable[Tenant | None]) -> tuple[Tenant | None, float]:
    return await found, math.inf


async def _cached(request: web.Request, key: str,
                  lookup: Callable[[], Awaitable[tuple[Tenant | None, float]]]
                  ) -> Tenant | None:
    cache, misses = request.app[AUTH_CACHE], request.app[AUTH_MISSES]
    now = time.monotonic()
    hit = cache.get(key)
    if hit is not None and hit[0] > now:
        return hit[1]
    missed = misses.get(key)
    if missed is not None and missed > now:
        return None
    found, lasts = await lookup()
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
    cache[key] = (min(expires, now + lasts), found)  # a session: never past its end
    return found
