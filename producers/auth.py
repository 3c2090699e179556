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

A request without a valid key (none, unknown, revoked, an ended session) spends its client
address's bucket instead (``api_unauthenticated_rate_per_second``): past it, 429
``unauthenticated_rate_limited``, and a key this process has not seen valid is not even
looked up, so a flood of made-up keys costs the database nothing more than its first few.
"""

from __future__ import annotations

import math
import time
from collections.abc import Awaitable, Callable
from typing import NoReturn

from aiohttp import web

from calmq.data import Tenant
from calmq.errors import ContractError
from calmq.producers.context import (
    AUTH_CACHE,
    AUTH_MISSES,
    RATE,
    SETTINGS,
    STORE,
    UNAUTHENTICATED,
)
from calmq.producers.throttle import Throttled

__all__ = ["COOKIE", "check_unauthenticated", "forget_session", "key_tenant", "limit",
           "session_tenant", "spend_unauthenticated", "tenant"]

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
        token = request.cookies[COOKIE]
        check_unauthenticated(request, _SESSION + token)
        found = await session_tenant(request, token)
        if found is None:
            _refuse(request, ContractError("the console session has ended; sign in again",
                                           code="invalid_api_key", status=401))
    else:
        if scheme.lower() != "bearer" or not key.strip():
            _refuse(request, ContractError("send Authorization: Bearer <api key>",
                                           code="missing_api_key", status=401))
        check_unauthenticated(request, key.strip())
        found = await key_tenant(request, key.strip())
        if found is None:
            _refuse(request, ContractError("the API key is unknown or revoked",
                                           code="invalid_api_key", status=401))
    assert found is not None
    limit(request, found)
    if roles and not any(found.can(r) for r in roles):
        raise ContractError(f"this API key has the role(s) {', '.join(found.roles)}; this "
                            f"needs {' or '.join(roles)} (calmq tenants add-key --roles)",
                            code="role_forbidden", status=403)
    return found


def _address(request: web.Request) -> str:
    # The TCP peer: a forwarded-for header is the client's to write, so it cannot be the key
    # of a limit on that client.
    return request.remote or ""


def _throttled(wait: float, rate: float) -> Throttled:
    return Throttled(
        f"this address sent more than {rate:g} requests a second without a valid API key; "
        f"try again in {wait:.2f} s (settings api_unauthenticated_rate_per_second, "
        "api_unauthenticated_rate_burst)", code="unauthenticated_rate_limited",
        retry_after=wait)


def check_unauthenticated(request: web.Request, key: str) -> None:
    """Before a lookup that reaches the database: 429 if the caller's address has spent its
    bucket of failed requests. A key this process has known as valid is let through even
    when its cache entry has expired: behind a shared proxy, one client's flood of made-up
    keys must not lock the proxy's other clients out."""
    hit = request.app[AUTH_CACHE].get(key)
    if hit is not None and hit[1] is not None:
        return
    bucket = request.app[UNAUTHENTICATED]
    wait = bucket.wait(_address(request))
    if wait > 0:
        raise _throttled(wait, bucket.rate)


def spend_unauthenticated(request: web.Request) -> None:
    """A request without a valid key spends its address's bucket: Throttled (429) when the
    bucket was empty already."""
    bucket = request.app[UNAUTHENTICATED]
    wait = bucket.take(_address(request))
    if wait > 0:
        raise _throttled(wait, bucket.rate)


def _refuse(request: web.Request, error: ContractError) -> NoReturn:
    """``error`` (a 401), spending the address's bucket; 429 when it was empty."""
    spend_unauthenticated(request)
    raise error


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
