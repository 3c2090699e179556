"""What ``build_app`` hands every handler: the application's typed keys.

A handler reads its dependencies from ``request.app[...]`` with these keys, never from a
module global, so one process can run two apps (tests do) and each route module stays free
of wiring.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

from aiohttp import web

from calmq.data import Store, Tenant
from calmq.objects import ObjectStore
from calmq.producers.intake import GroupCommit
from calmq.producers.notifications import Hub
from calmq.producers.throttle import RateLimiter, TenantGates
from calmq.settings import Settings
from calmq.workflows import Workflow

__all__ = ["AUTH_CACHE", "AUTH_MISSES", "GATES", "GROUP_COMMIT", "HUB", "OBJECTS", "OPENAPI",
           "RATE", "SETTINGS", "STORE", "UNAUTHENTICATED", "WORKFLOWS"]

STORE = web.AppKey("store", Store)
SETTINGS = web.AppKey("settings", Settings)
WORKFLOWS = web.AppKey("workflows", dict[str, Workflow])
OBJECTS = web.AppKey("objects", ObjectStore)
# API key -> (monotonic expiry, tenant or None for an unknown key)
AUTH_CACHE = web.AppKey("auth_cache", dict[str, tuple[float, Tenant | None]])
# Unknown keys -> monotonic expiry, apart and bounded (setting auth_cache_max_misses), so a
# flood of random keys cannot push the known ones out of AUTH_CACHE.
AUTH_MISSES = web.AppKey("auth_misses", OrderedDict[str, float])
# Fair use: a token bucket per key, and per-tenant caps on streams and expensive reads.
RATE = web.AppKey("rate", RateLimiter)
# A token bucket per client address, spent by requests without a valid key.
UNAUTHENTICATED = web.AppKey("unauthenticated", RateLimiter)
GATES = web.AppKey("gates", TenantGates)
GROUP_COMMIT = web.AppKey("group_commit", GroupCommit)
HUB = web.AppKey("hub", Hub)
# The OpenAPI document, generated once when the app is built (it depends on the workflows).
OPENAPI = web.AppKey("openapi", dict[str, Any])
