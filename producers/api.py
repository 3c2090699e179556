"""The intake API (aiohttp): the application assembly — error middleware, wiring, background.

The routes live by resource in producers.routes; their bodies are the models of
producers.models; /openapi.json is generated from both by producers.openapi. Every error is
application/problem+json with a stable ``code`` (docs/reference/api.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from typing import Any

import psycopg
from aiohttp import web
from prometheus_client import Counter
from psycopg_pool import PoolTimeout

from calmq.data import Store
from calmq.errors import CalmqError, ContractError
from calmq.objects import ObjectStore, open_object_store
from calmq.producers.backlog import QueueAge, SlotWatch, TableWatch, slot_gauges, table_gauges
from calmq.producers.console import add_console
from calmq.producers.context import (
    AUTH_CACHE,
    AUTH_MISSES,
    GATES,
    GROUP_COMMIT,
    HUB,
    OBJECTS,
    OPENAPI,
    RATE,
    SETTINGS,
    STORE,
    UNAUTHENTICATED,
    WORKFLOWS,
)
from calmq.producers.intake import GroupCommit
from calmq.producers.notifications import KEYS, WEBHOOKS, Hub
from calmq.producers.openapi import document
from calmq.producers.parsing import storable
from calmq.producers.problems import problem
from calmq.producers.retention import Sweeper
from calmq.producers.routes import ROUTES
from calmq.producers.throttle import RateLimiter, TenantGates, Throttled
from calmq.producers.views import job_view
from calmq.producers.webhooks import Dispatcher
from calmq.settings import PROBLEM_BASE_URL, Settings
from calmq.supervision import Supervisor
from calmq.workflows import Workflow, load_workflows

__all__ = ["ROUTES", "build_app"]

log = logging.getLogger(__name__)

REJECTED = Counter("calmq_requests_rejected_total", "Requests rejected", ["code"])


@web.middleware
async def _errors(request: web.Request, handler: Any) -> web.StreamResponse:
    # The metrics-only app has no settings: its problems point at the default docs.
    settings = request.app.get(SETTINGS)
    base = settings.api_problem_base_url if settings is not None else PROBLEM_BASE_URL
    try:
        # A NUL (or a lone surrogate) in a query parameter would reach PostgreSQL as a text
        # parameter it refuses: a 400 here, for every route at once.
        for name, value in request.query.items():
            if not (storable(name) and storable(value)):
                raise ContractError("a query parameter holds a NUL character or a byte that "
                                    "is not UTF-8", code="invalid_query")
        return await handler(request)  # type: ignore[no-any-return]
    except Throttled as exc:
        REJECTED.labels(exc.code).inc()
        response = problem(exc.status, exc.code, exc.message, base=base)
        response.headers["Retry-After"] = exc.retry_after_header
        return response
    except ContractError as exc:
        REJECTED.labels(exc.code).inc()
        return problem(exc.status, exc.code, exc.message, base=base)
    except web.HTTPRequestEntityTooLarge:
        REJECTED.labels("body_too_large").inc()
        limit = settings.max_body_bytes if settings is not None else "size"
        return problem(413, "body_too_large", f"the body is over the {limit} byte limit",
                       base=base)
    except web.HTTPNotFound:
        return problem(404, "no_route", f"no route for {request.method} {request.path}",
                       base=base)
    except web.HTTPMethodNotAllowed:
        return problem(405, "method_not_allowed",
                       f"{request.method} is not allowed on {request.path}", base=base)
    except CalmqError as exc:
        log.exception("request failed")
        return problem(503, exc.code, exc.message, base=base)
    except (psycopg.OperationalError, PoolTimeout):
        # The database is away (a failover, a restart, a partition): the client's retry
        # will do, so 503 with Retry-After, not 500. The driver's text (addresses, users,
        # server messages) goes to the log only, never into the answer.
        log.exception("database unavailable")
        response = problem(503, "database_unavailable",
                           "the database is unavailable; try again shortly", base=base)
        response.headers["Retry-After"] = "1"
        return response
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except web.HTTPException as exc:
        return problem(exc.status, "http_error", exc.reason, base=base)
    except Exception:
        log.exception("unexpected error")
        return problem(500, "internal_error", "an unexpected error; it has been logged",
                       base=base)


def build_app(
    settings: Settings,
    store: Store,
    *,
    workflows: dict[str, Workflow] | None = None,
    objects: ObjectStore | None = None,
    background: bool = True,
) -> web.Application:
    """The API application; ``background`` starts LISTEN, webhooks and retention with it."""
    app = web.Application(middlewares=[_errors], client_max_size=settings.max_body_bytes)
    app[STORE] = store
    app[SETTINGS] = settings
    registry = workflows or load_workflows(settings)
    app[WORKFLOWS] = registry
    app[OBJECTS] = objects or open_object_store(settings.object_store_url)
    app[AUTH_CACHE] = {}
    app[AUTH_MISSES] = OrderedDict()
    app[RATE] = RateLimiter(settings.api_rate_per_second, settings.api_rate_burst)
    app[UNAUTHENTICATED] = RateLimiter(settings.api_unauthenticated_rate_per_second,
                                       settings.api_unauthenticated_rate_burst)
    app[GATES] = TenantGates(streams=settings.api_streams_per_tenant,
                             reads=settings.api_reads_per_tenant)
    app[GROUP_COMMIT] = GroupCommit(store.pool, max_batch=settings.accept_batch_max)
    app[HUB] = Hub(settings.listen_database_url)  # LISTEN: never through a pooler
    app[OPENAPI] = document(ROUTES, registry)
    # /metrics and the console may each have a port of their own, so that a NetworkPolicy
    # (or an Ingress) can open the API to clients without opening them too.
    own_ports: list[tuple[web.Application, int]] = []
    for route in ROUTES:
        if route.path == "/metrics" and settings.api_metrics_port is not None:
            metrics = web.Application(middlewares=[_errors])
            metrics.router.add_route(route.method, route.path, route.handler)
            own_ports.append((metrics, settings.api_metrics_port))
            continue
        app.router.add_route(route.method, route.path, route.handler)
    if settings.api_console and settings.api_console_port is not None:
        console = web.Application(middlewares=[_errors], client_max_size=settings.max_body_bytes)
        # The same objects: one store, one cache, one hub, one bucket per key (a console
        # page spends the same bucket as a /v1 call).
        console[STORE], console[SETTINGS], console[WORKFLOWS] = store, settings, registry
        console[OBJECTS], console[AUTH_CACHE] = app[OBJECTS], app[AUTH_CACHE]
        console[AUTH_MISSES], console[RATE], console[GATES] = (
            app[AUTH_MISSES], app[RATE], app[GATES])
        console[GROUP_COMMIT], console[HUB], console[OPENAPI] = (
            app[GROUP_COMMIT], app[HUB], app[OPENAPI])
        console[UNAUTHENTICATED] = app[UNAUTHENTICATED]
        add_console(console)
        own_ports.append((console, settings.api_console_port))
    elif settings.api_console:
        add_console(app)  # the web console's pages (not in ROUTES: not in /openapi.json)
    runners: list[web.AppRunner] = []

    async def start_own_ports(_app: web.Application) -> None:
        for sub, port in own_ports:
            runner = web.AppRunner(sub, access_log=None)
            await runner.setup()
            await web.TCPSite(runner, settings.api_host, port).start()
            runners.append(runner)

    async def stop_own_ports(_app: web.Application) -> None:
        for runner in runners:
            await runner.cleanup()

    hub = app[HUB]
    hub.on(KEYS, app[AUTH_CACHE].clear)  # a revoked key stops working at once
    hub.on(KEYS, app[AUTH_MISSES].clear)  # and a new one at once
    dispatcher = Dispatcher(settings, store, job_view)
    sweeper = Sweeper(settings, store, app[OBJECTS])
    pools = {wf.pool_of(step) for wf in registry.values() for step in wf.steps}
    queue_age = QueueAge(store, settings.queue_age_interval_seconds, pools)
    # The slots on the same clock as the queue age: both are database-side gauges that must
    # keep moving when the part they describe (workers, the relay) is down.
    slots = SlotWatch(store, settings.queue_age_interval_seconds)
    tables = TableWatch(store, settings.table_health_interval_seconds)

    # The side tasks: a failed pass is logged, counted and tried again; none of them stops
    # the API (accepting jobs matters more than any of them).
    side = Supervisor()

    async def start_background(_app: web.Application) -> None:
        if not background:
            return
        side.spawn("notification-hub", hub.run)
        if settings.webhook_dispatcher:
            hub.on(WEBHOOKS, dispatcher.wake)
            side.spawn("webhook-dispatcher", dispatcher.run)
        side.every("retention-sweeper", sweeper.interval, sweeper.sweep)
        queue_age.declare()  # present on /metrics from the start, even with nothing waiting
        slot_gauges()
        if queue_age.interval > 0:
            side.every("queue-age", queue_age.interval, queue_age.sample)
            side.every("replication-slots", slots.interval, slots.sample)
        table_gauges()
        if tables.interval > 0:
            side.every("table-health", tables.interval, tables.sample)

    async def stop_background(_app: web.Application) -> None:
        await side.stop()
        with contextlib.suppress(Exception):
            await dispatcher.close()
        await store.close()

    async def close_streams(_app: web.Application) -> None:
        hub.close_streams()  # open SSE streams must not hold the shutdown for a minute

    app.on_startup.append(start_own_ports)
    app.on_startup.append(start_background)
    app.on_shutdown.append(close_streams)
    app.on_cleanup.append(stop_own_ports)
    app.on_cleanup.append(stop_background)
    return app
