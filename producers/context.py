"""What ``build_app`` hands every handler: the application's typed keys.

A handler reads its dependencies from ``request.app[...]`` with these keys, never from a
module global, so one process can run two apps (tests do) and each route module stays free
of wiring.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from calmq.data import Store, Tenant
from calmq.objects import ObjectStore
from calmq.producers.intake import GroupCommit
from calmq.producers.notifications import Hub
from calmq.settings import Settings
from calmq.workflows import Workflow

__all__ = ["AUTH_CACHE", "GROUP_COMMIT", "HUB", "OBJECTS", "OPENAPI", "SETTINGS", "STORE",
           "WORKFLOWS"]

STORE = web.AppKey("store", Store)
SETTINGS = web.AppKey("settings", Settings)
WORKFLOWS = web.AppKey("workflows", dict[str, Workflow])
OBJECTS = web.AppKey("objects", ObjectStore)
# API key -> (monotonic expiry, tenant or None for an unknown key)
AUTH_CACHE = web.AppKey("auth_cache", dict[str, tuple[float, Tenant | None]])
GROUP_COMMIT = web.AppKey("group_commit", GroupCommit)
HUB = web.AppKey("hub", Hub)
# The OpenAPI document, generated once when the app is built (it depends on the workflows).
OPENAPI = web.AppKey("openapi", dict[str, Any])
