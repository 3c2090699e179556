"""Who is calling: the tenant of a request's bearer API key, cached for a few seconds.

The cache keeps a database round trip off every accept; a revoked key still stops working
at once because build_app clears the cache on the key-change notification.
"""

from __future__ import annotations

import time

from aiohttp import web

from calmq.data import Tenant
from calmq.errors import ContractError
from calmq.producers.context import AUTH_CACHE, SETTINGS, STORE

__all__ = ["tenant"]

_CACHE_MAX = 10_000


async def tenant(request: web.Request) -> Tenant:
    """The caller's tenant; ContractError 401 for a missing, unknown or revoked key."""
    header = request.headers.get("Authorization", "")
    scheme, _, key = header.partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise ContractError("send Authorization: Bearer <api key>", code="missing_api_key",
                            status=401)
    key = key.strip()
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
    if found is None:
        raise ContractError("the API key is unknown or revoked", code="invalid_api_key",
                            status=401)
    return found
