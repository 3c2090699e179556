"""The long-running parts: API, relay, worker, forwarder, reaper, batcher; each until SIGTERM."""

from __future__ import annotations

import argparse
import asyncio
import functools
import gc
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from calmq.cli.flags import Command, Flags, configure_logging, settings_for
from calmq.errors import ConfigError
from calmq.heartbeat import Heartbeat, with_heartbeat

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry, Histogram

    from calmq.settings import Settings

__all__ = ["register"]

_BOTH = ("database_url", "kafka_bootstrap")


def cmd_api(args: argparse.Namespace) -> int:
    from aiohttp import web

    from calmq.data import Store
    from calmq.producers.api import build_app

    settings = settings_for(args)
    configure_logging(settings.log_level, settings.log_redact_fields)
    settings.listen_database_url  # noqa: B018 - behind a pooler: fail now without a direct URL
    _long_running()

    async def make() -> web.Application:
        store = Store(settings.database_url, max_size=16,
                      keep_errors=settings.max_job_errors, **Store.pool_options(settings))
        await store.open()
        return build_app(settings, store)

    web.run_app(make(), host=settings.api_host, port=settings.api_port, print=None,
                access_log=None, handle_signals=True)
    return 0


# Collections are timed, not counted: young objects every _YOUNG_COLLECTION_SECONDS, all of
# them every _FULL_COLLECTION_SECONDS (see _long_running).
_YOUNG_COLLECTION_SECONDS = 0.1
_FULL_COLLECTION_SECONDS = 60.0


def _long_running() -> None:
    """Garbage collection for a service process, called once its modules are loaded.

    perf on a worker at ~700 jobs/s: 12 % of its CPU in the cyclic collector, which kept
    walking the tens of thousands of objects every import leaves behind. Those are frozen
    (never scanned again).

    The collector stops the whole process for as long as it walks what it collects, and a
    worker holding 5,000 calls keeps ~350,000 objects alive (each call's coroutines, frames,
    cells), each living 8-40 s. Counted collections made that 100-300 ms pauses every few
    seconds (``calmq bench longcalls``: loop lag p99 180-225 ms, against 50 ms): CPython
    counts the young generation down on every deallocation, old objects' included, so at a
    steady rate of calls it grew to 350,000 objects between collections; the middle
    generation then walked the same calls again; and the interpreter collects everything
    once a quarter more objects than the last full collection kept were promoted, which
    such calls reach within seconds. So the interpreter's own collections are off, and a
    thread collects the two young generations together every 0.1 s (survivors go straight
    to the oldest one: each call is walked once, a few milliseconds' worth at a time) and
    everything once a minute (what frees cycles that grew old: a failed attempt's traceback).
    """
    gc.collect()
    gc.freeze()
    gc.disable()
    _observe_gc_pauses()
    threading.Thread(target=_collect, args=(_YOUNG_COLLECTION_SECONDS,
                                            _FULL_COLLECTION_SECONDS),
                     name="calmq-gc", daemon=True).start()


def _collect(young_every: float, full_every: float,
             stop: threading.Event | None = None) -> None:
    """Collect the young generations every ``young_every`` s, all every ``full_every`` s,
    until ``stop`` (never, in a service: the thread ends with the process)."""
    stop = stop or threading.Event()
    full_at = time.monotonic() + full_every
    while not stop.wait(young_every):  # a timer: nothing else waits on this thread
        if time.monotonic() >= full_at:
            gc.collect()
            full_at = time.monotonic() + full_every
        else:
            gc.collect(1)


@functools.cache
def gc_pause_histogram(registry: CollectorRegistry | None = None) -> Histogram:
    """The histogram, made once per registry (the default: the process's)."""
    from prometheus_client import REGISTRY, Histogram

    return Histogram("calmq_gc_pause_seconds", "Time the cyclic garbage collector stopped "
                     "the process, per collection", ["generation"],
                     buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
                     registry=REGISTRY if registry is None else registry)


def _observe_gc_pauses(registry: CollectorRegistry | None = None
                       ) -> Callable[[str, dict[str, int]], None]:
    """``calmq_gc_pause_seconds{generation}``: a collection stops the event loop for as long
    as it walks its generations, so a worker holding thousands of attempts sees it as loop
    lag (``calmq_event_loop_lag_seconds``); this says how much of that lag is the collector.
    Returns the callback it added to ``gc.callbacks``."""
    import time

    pauses = gc_pause_histogram(registry)
    by_generation = [pauses.labels(str(g)) for g in range(3)]
    started = 0.0

    def timed(phase: str, info: dict[str, int]) -> None:
        nonlocal started
        if phase == "start":
            started = time.perf_counter()
        else:
            by_generation[info["generation"]].observe(time.perf_counter() - started)

    gc.callbacks.append(timed)
    return timed


def _metrics_server(port: int | None, host: str) -> Heartbeat:
    """Serve /metrics on ``host`` (``metrics_host``): all interfaces in a pod, where
    Prometheus scrapes the pod's IP; loopback in `calmq dev up`. The same port is the
    probe of the parts that have no HTTP API (docs/how-to/deploy-kubernetes.md): /livez
    answers from the returned heartbeat, which the part's event loop must keep beating
    (``with_heartbeat``), so a wedged loop fails liveness."""
    from calmq.heartbeat import serve_metrics

    heartbeat = Heartbeat()
    if port:
        serve_metrics(int(port), host, heartbeat)
    return heartbeat


def cmd_relay(args: argparse.Namespace) -> int:
    import signal

    from confluent_kafka import Producer

    from calmq.codec import make_codec, registry_config
    from calmq.kafka import producer_config, service_connection
    from calmq.relay import Publisher, drop_slot, make_relay

    if args.drop_slot:  # a database-only act: it must not ask for Kafka's address
        args.needs = ("database_url",)
    settings = settings_for(args)
    configure_logging(settings.log_level, settings.log_redact_fields)
    if args.drop_slot:
        from calmq.cli.probes import check_database

        check_database(settings)  # one error line with the address, not a traceback
        dropped = drop_slot(settings.effective_relay_database_url, settings.relay_slot)
        print(f"dropped replication slot {settings.relay_slot}" if dropped
              else f"no replication slot {settings.relay_slot} in this database")
        return 0
    if args.metrics_port:  # a thread loop, no event loop: /livez answers while it runs
        from calmq.heartbeat import serve_metrics

        serve_metrics(int(args.metrics_port), settings.metrics_host)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    # linger.ms 0: the relay is on every job's accept→dispatch path, and its records come
    # a transaction at a time already; the 2 ms linger only delayed a quiet moment's first
    # record (under load, what accumulates while requests are in flight still batches).
    publisher = Publisher(Producer(producer_config(service_connection(settings),
                                                  compression=settings.kafka_compression,
                                                  **{"linger.ms": 0,
                                                     "message.max.bytes":
                                                         settings.kafka_max_message_bytes})),
                          make_codec(settings.schema_registry_url, registry_config(settings),
                                     settings.name_prefix),
                          topic_replacement=settings.name_prefix
                          + settings.relay_topic_replacement)
    _long_running()
    make_relay(settings, publisher).run(stop)
    return 0


def _needs_provider(settings: Settings, command: str) -> None:
    """A worker or batcher without a provider URL would fail every call it makes (outside
    the local stack, whose fake provider fills it): refuse to start instead."""
    if not settings.effective_provider_url:
        raise ConfigError(
            f"calmq {command} has no model provider: set CALMQ_PROVIDER_URL (and "
            "CALMQ_PROVIDER, CALMQ_PROVIDER_API_KEY), or start the local stack (calmq dev up)",
            code="no_provider")


def cmd_worker(args: argparse.Namespace) -> int:
    from calmq.processors.worker import Worker

    settings = settings_for(args)
    _needs_provider(settings, "worker")
    configure_logging(settings.log_level, settings.log_redact_fields)
    heartbeat = _metrics_server(args.metrics_port, settings.metrics_host)
    _long_running()
    asyncio.run(with_heartbeat(Worker(settings).run(), heartbeat))
    return 0


def cmd_batcher(args: argparse.Namespace) -> int:
    from calmq.errors import UsageError
    from calmq.processors.batcher import BatchLane

    if args.pack_only and args.poll_only:
        raise UsageError("--pack-only and --poll-only exclude each other (neither: both "
                         "roles)", code="conflicting_flags")
    settings = settings_for(args)
    _needs_provider(settings, "batcher")
    configure_logging(settings.log_level, settings.log_redact_fields)
    heartbeat = _metrics_server(args.metrics_port, settings.metrics_host)
    _long_running()
    asyncio.run(with_heartbeat(
        BatchLane(settings, pack=not args.poll_only, poll=not args.pack_only).run(), heartbeat))
    return 0


def cmd_forwarder(args: argparse.Namespace) -> int:
    from confluent_kafka import Producer

    from calmq import topics
    from calmq.codec import make_codec, registry_config
    from calmq.kafka import consumer_config, producer_config, service_connection
    from calmq.processors.forwarder import Forwarder, ForwarderService

    settings = settings_for(args)
    configure_logging(settings.log_level, settings.log_redact_fields)
    heartbeat = _metrics_server(args.metrics_port, settings.metrics_host)
    tier_topics = [topics.topic_for_route(topics.retry_route(t)) for t, _ in
                   settings.retry_tier_list]
    connection = service_connection(settings)
    forwarder = Forwarder(consumer_config(connection, topics.FORWARDER_GROUP),
                          Producer(producer_config(connection,
                                                   compression=settings.kafka_compression)),
                          make_codec(settings.schema_registry_url, registry_config(settings),
                                     settings.name_prefix),
                          tier_topics, commit_interval=settings.commit_interval_ms / 1000)
    asyncio.run(with_heartbeat(
        ForwarderService(forwarder, grace_seconds=settings.grace_seconds).run(), heartbeat))
    return 0


def cmd_reaper(args: argparse.Namespace) -> int:
    from calmq.processors.reaper import Reaper

    settings = settings_for(args)
    configure_logging(settings.log_level, settings.log_redact_fields)
    heartbeat = _metrics_server(args.metrics_port, settings.metrics_host)
    asyncio.run(with_heartbeat(Reaper(settings).run(), heartbeat))
    return 0


def register(command: Command, flags: Flags) -> None:
    setting, option = flags.setting, flags.option
    p = command("api", cmd_api, "run the intake API", needs=_BOTH)
    setting(p, "api_port")
    setting(p, "api_host")
    p = command("relay", cmd_relay, "run the outbox relay", needs=_BOTH)
    option(p, "--metrics-port", type=int, help="serve /metrics on this port (default: none)")
    setting(p, "relay_mode", "--mode")
    setting(p, "relay_slot")
    # No CALMQ_ variable: an exported one would drop the slot at every start.
    p.add_argument("--drop-slot", action="store_true",
                   help="remove the relay's replication slot on purpose, then exit")
    p = command("worker", cmd_worker, "run a stream processor", needs=_BOTH)
    setting(p, "pool")
    setting(p, "priorities")
    setting(p, "concurrency")
    option(p, "--metrics-port", type=int, help="serve /metrics on this port (default: none)")
    setting(p, "step_timeout_seconds")
    setting(p, "max_attempts")
    p = command("batcher", cmd_batcher, "the batch lane: pack calmq.<pool>.batch jobs into "
                "provider batches and collect their results", needs=_BOTH)
    setting(p, "pool")
    option(p, "--metrics-port", type=int, help="serve /metrics on this port (default: none)")
    setting(p, "batch_max_requests")
    setting(p, "batch_max_age_seconds")
    setting(p, "batch_poll_interval_seconds")
    option(p, "--pack-only", action="store_true",
           help="only pack jobs into batches (run the poller elsewhere)")
    option(p, "--poll-only", action="store_true",
           help="only collect batches (the poller; run as many as you like)")
    p = command("forwarder", cmd_forwarder, "retry-tier forwarder: republish retries when due",
                needs=_BOTH)
    option(p, "--metrics-port", type=int, help="serve /metrics on this port (default: none)")
    p = command("reaper", cmd_reaper, "requeue jobs whose lease expired",
                needs=("database_url",))
    option(p, "--metrics-port", type=int, help="serve /metrics on this port (default: none)")
