"""On-call at a glance: consumer lag, the token budget, the health of every part.

Each reads, never writes, and answers within seconds: every connection it opens has a
timeout of a few seconds, and an unreachable part is one error line naming its address.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse, urlunparse

from calmq.cli.connect import CONNECT_TIMEOUT_SECONDS, database_address, open_store
from calmq.cli.flags import Command, Flags, settings_for
from calmq.cli.output import Exit, add_output, emit_one, emit_rows, output_format
from calmq.cli.probes import kafka_config, kafka_unreachable, open_admin
from calmq.errors import CalmqError
from calmq.jobs import Priority

if TYPE_CHECKING:
    from calmq.data.operations import InFlight
    from calmq.kafka import Connection
    from calmq.settings import Settings

__all__ = ["PartitionLag", "read_lag", "register"]

# Broker requests of these commands; a person waits on each, so they are short.
KAFKA_TIMEOUT_SECONDS = 3.0
# How long `lag` reads for the first uncommitted message of the lagging partitions.
PEEK_SECONDS = 3.0
_PRIORITIES = tuple(p.value for p in Priority)


# -- Kafka -------------------------------------------------------------------------------

def work_topics(names: Sequence[str]) -> dict[str, list[tuple[str, str]]]:
    """``calmq.<pool>.<priority>`` topics by pool, as (topic, priority): the broker's topics
    say which pools exist, so a pool named only in another deployment's settings is found."""
    from calmq import topics

    found: dict[str, list[tuple[str, str]]] = {}
    for name in sorted(names):
        if not name.startswith(topics.PREFIX):
            continue
        pool, _, priority = name[len(topics.PREFIX):].rpartition(".")
        if priority in _PRIORITIES and pool and pool != "retry" and "." not in pool:
            found.setdefault(pool, []).append((name, priority))
    return found


@dataclass
class PartitionLag:
    """One partition of a work topic, as the pool's consumer group sees it."""

    pool: str
    topic: str
    priority: str
    partition: int
    group: str
    start_offset: int  # the low watermark: older messages are gone (retention)
    end_offset: int  # the high watermark: the next message's offset
    committed_offset: int | None  # None: the group never committed on this partition
    lag: int
    oldest_age_seconds: float | None  # the first uncommitted message's age; None: no lag


def read_lag(connection: Connection, pools: Sequence[str] = ()) -> list[PartitionLag]:
    """Per partition of every pool's work topics: offsets, lag and the oldest message's age.

    Read by the kernel's lag reader (calmq.lag: no group membership, so the workers'
    assignment is not disturbed, and none of the admin client's group requests); a
    partition never committed counts from its low watermark, as the workers' gauge does.
    """
    from confluent_kafka import KafkaException

    from calmq import topics
    from calmq.kafka import check_connection
    from calmq.lag import LagReader

    bootstrap = connection if isinstance(connection, str) else connection["bootstrap.servers"]
    reader = LagReader(kafka_config(connection), timeout=KAFKA_TIMEOUT_SECONDS)
    try:
        by_pool = work_topics(list(reader.topics()))
        if pools:
            by_pool = {p: t for p, t in by_pool.items() if p in pools}
        priority_of = {name: (pool, priority) for pool, names in by_pool.items()
                       for name, priority in names}
        read = reader.read_groups({topics.worker_group(pool): [n for n, _ in names]
                                   for pool, names in by_pool.items()})
    except KafkaException as exc:
        # The reader's error says only "transport failure"; the probe reads librdkafka's
        # log for the cause a setting cures (wrong credentials, TLS, protocol) and names it.
        check_connection({k: v for k, v in kafka_config(connection).items() if k != "logger"},
                         KAFKA_TIMEOUT_SECONDS)
        raise kafka_unreachable(bootstrap, exc.args[0] if exc.args else exc) from exc
    finally:
        reader.close()
    rows = [PartitionLag(pool=priority_of[r.topic][0], topic=r.topic,
                         priority=priority_of[r.topic][1], partition=r.partition,
                         group=r.group, start_offset=r.start_offset, end_offset=r.end_offset,
                         committed_offset=r.committed_offset, lag=r.lag,
                         oldest_age_seconds=None) for r in read]
    _oldest_ages(connection, [r for r in rows if r.lag > 0])
    return rows


def _oldest_ages(connection: Connection, lagging: list[PartitionLag]) -> None:
    """Fill in each lagging partition's oldest message age: the timestamp of the message at
    its committed offset (the next one the group will process).

    One consumer ``assign``s the partitions at those offsets: assigning joins no group, so the
    workers' group neither rebalances nor sees a new member, and nothing is committed. A
    partition whose message does not arrive within PEEK_SECONDS keeps None.
    """
    if not lagging:
        return
    from confluent_kafka import Consumer, TopicPartition

    from calmq import topics

    consumer = Consumer(kafka_config(
        connection, **{"group.id": topics.PREFIX + "cli.lag-peek", "enable.auto.commit": False,
                      "enable.auto.offset.store": False, "enable.partition.eof": False,
                      "fetch.wait.max.ms": 50}))
    wanted = {(r.topic, r.partition): r for r in lagging}
    try:
        consumer.assign([TopicPartition(r.topic, r.partition,
                                        r.end_offset - r.lag) for r in lagging])
        deadline = time.monotonic() + PEEK_SECONDS
        while wanted and time.monotonic() < deadline:
            for msg in consumer.consume(num_messages=len(wanted), timeout=0.2):
                key = (str(msg.topic()), int(msg.partition() or 0))
                row = wanted.pop(key, None)
                if row is None or msg.error() is not None:
                    continue
                _kind, ms = msg.timestamp()
                row.oldest_age_seconds = round(max(0.0, time.time() - ms / 1000), 3)
                consumer.pause([TopicPartition(*key)])
    finally:
        consumer.close()


def _in_flight(settings: Settings) -> tuple[dict[tuple[str, str], InFlight], str | None]:
    """Jobs held by workers and waiting, per (pool, priority), or why they are unknown."""
    if not settings.database_url:
        return {}, "no database set (CALMQ_DATABASE_URL)"

    async def read() -> list[InFlight]:
        from calmq.data.operations import Operations

        async with open_store(settings, max_size=1) as store:
            return await Operations(store).in_flight()

    try:
        rows = asyncio.run(read())
    except CalmqError as exc:
        return {}, exc.message
    return {(r.pool, r.priority): r for r in rows}, None


def cmd_lag(args: argparse.Namespace) -> int:
    import sys

    settings = settings_for(args)
    pools = [p.strip() for p in (args.pools or "").split(",") if p.strip()]
    from calmq.kafka import connection_config

    rows = read_lag(connection_config(settings), pools)
    jobs, unknown = _in_flight(settings)
    if unknown:
        print(f"calmq: warning: jobs in flight unknown: {unknown}", file=sys.stderr)
    out: list[dict[str, Any]] = []
    totals: dict[str, dict[str, Any]] = {}
    for r in rows:
        out.append({"kind": "partition", **asdict(r), "in_flight": None, "waiting": None})
        total = totals.setdefault(r.topic, {
            "kind": "topic", "pool": r.pool, "topic": r.topic, "priority": r.priority,
            "partition": None, "group": r.group, "partitions": 0, "end_offset": 0,
            "committed_offset": 0, "lag": 0, "oldest_age_seconds": None,
            # Jobs are counted per topic: PostgreSQL knows a job's pool and priority, not
            # the partition its message went to.
            "in_flight": None, "waiting": None})
        total["partitions"] += 1
        total["end_offset"] += r.end_offset
        total["committed_offset"] += r.committed_offset or 0
        total["lag"] += r.lag
        if r.oldest_age_seconds is not None:
            total["oldest_age_seconds"] = max(total["oldest_age_seconds"] or 0.0,
                                              r.oldest_age_seconds)
        if unknown is None:
            held = jobs.get((r.pool, r.priority))
            total["in_flight"] = held.in_flight if held else 0
            total["waiting"] = held.waiting if held else 0
    fmt = output_format(args)
    if fmt != "table":
        emit_rows([*out, *totals.values()], fmt, [])
        return Exit.OK
    if not rows:
        print("no work topics (calmq.<pool>.<priority>) in this cluster"
              + (f" for pool(s) {', '.join(pools)}" if pools else ""))
        return Exit.OK
    emit_rows(out, fmt, ["topic", "partition", "end_offset", "committed_offset", "lag",
                         "oldest_age_seconds"])
    print()
    emit_rows(list(totals.values()), fmt, ["topic", "group", "lag", "oldest_age_seconds",
                                           "in_flight", "waiting"])
    return Exit.OK


# -- budget ------------------------------------------------------------------------------

def _bucket_view(b: Any) -> dict[str, Any]:
    """A bucket row as people read it: per priority what is left now and what is owed."""
    share = b.interactive_share
    return {
        "provider": b.provider, "model": b.model,
        "tokens_per_minute": b.tokens_per_minute, "requests_per_minute": b.requests_per_minute,
        "interactive_share": share, "paused_until": b.paused_until, "updated_at": b.updated_at,
        "priorities": {
            "interactive": {"tokens_left": round(max(0.0, b.interactive_tokens), 1),
                            "tokens_cap": round(b.token_cap * share, 1),
                            "requests_left": round(max(0.0, b.interactive_requests), 2),
                            "debt_tokens": round(max(0.0, -b.interactive_tokens), 1),
                            "debt_requests": round(max(0.0, -b.interactive_requests), 2)},
            "bulk": {"tokens_left": round(max(0.0, b.bulk_tokens), 1),
                     "tokens_cap": round(b.token_cap * (1 - share), 1),
                     "requests_left": round(max(0.0, b.bulk_requests), 2),
                     "debt_tokens": round(max(0.0, -b.bulk_tokens), 1),
                     "debt_requests": round(max(0.0, -b.bulk_requests), 2)},
        },
    }


def cmd_budget(args: argparse.Namespace) -> int:
    from calmq.data.operations import Operations
    from calmq.settings import parse_duration

    settings = settings_for(args)
    window = parse_duration(args.window or "60s")

    async def read() -> tuple[list[Any], list[Any], list[Any]]:
        from calmq.data.providers import ProviderLedger

        async with open_store(settings, max_size=1) as store:
            ops = Operations(store)
            return (await ops.buckets(), await ops.usage(window),
                    await ProviderLedger(store).states())

    buckets, usage, providers = asyncio.run(read())
    by_priority: dict[str, dict[str, int]] = {
        p: {"tokens": 0, "model_calls": 0, "attempts": 0} for p in _PRIORITIES}
    tenants = []
    for u in usage:
        tokens = u.input_tokens + u.output_tokens
        row = by_priority.setdefault(u.priority, {"tokens": 0, "model_calls": 0, "attempts": 0})
        row["tokens"] += tokens
        row["model_calls"] += u.model_calls
        row["attempts"] += u.attempts
        tenants.append({**asdict(u), "tokens": tokens})
    report: dict[str, Any] = {
        # This shell's settings: what a worker started here would configure. The buckets
        # hold what the fleet runs with (the last worker to start wrote them).
        "settings": {"tokens_per_minute": settings.budget_tokens_per_minute,
                     "requests_per_minute": settings.budget_requests_per_minute,
                     "interactive_share": settings.budget_interactive_share,
                     "burst_seconds": settings.budget_burst_seconds},
        "buckets": [_bucket_view(b) for b in buckets],
        "window_seconds": window,
        "use_by_priority": [{"priority": p, **v} for p, v in by_priority.items()],
        "use_by_tenant": tenants,
        "in_debt": any(v["debt_tokens"] > 0 or v["debt_requests"] > 0
                       for b in buckets for v in _bucket_view(b)["priorities"].values()),
        # Blocks, rate-limit pauses and the limits the providers state (calmq.calls.gate).
        "providers": [asdict(p) for p in providers],
    }
    fmt = output_format(args)
    if fmt != "table":
        emit_one(report, fmt)
        return Exit.OK
    s = report["settings"]
    print(f"settings here: {s['tokens_per_minute'] or 'no'} tokens/min, "
          f"{s['requests_per_minute'] or 'no'} requests/min, interactive share "
          f"{s['interactive_share']:.0%}")
    if not buckets:
        print("no shared budget in this database (no worker started with "
              "CALMQ_BUDGET_TOKENS_PER_MINUTE or CALMQ_BUDGET_REQUESTS_PER_MINUTE)")
    for p in providers:
        state = (f"BLOCKED ({p.blocked_reason}): {(p.blocked_message or '')[:120]}"
                 if p.blocked_reason else
                 f"paused {p.paused_seconds:.1f} s more" if p.paused_seconds > 0 else "ok")
        print(f"{p.provider}/{p.model}: {state}; the provider states "
              f"{p.observed_tokens_per_minute or '?'} tokens/min, "
              f"{p.observed_requests_per_minute or '?'} requests/min")
    for b in report["buckets"]:
        paused = f", PAUSED until {b['paused_until']:%H:%M:%S}" if b["paused_until"] else ""
        print(f"\n{b['provider']}/{b['model']}: {b['tokens_per_minute']} tokens/min, "
              f"{b['requests_per_minute']} requests/min{paused}")
        emit_rows([{"priority": p, **v} for p, v in b["priorities"].items()], fmt,
                  ["priority", "tokens_left", "tokens_cap", "requests_left", "debt_tokens",
                   "debt_requests"])
    print(f"\nuse in the last {window:g} s, by priority:")
    emit_rows(report["use_by_priority"], fmt, ["priority", "tokens", "model_calls", "attempts"])
    print(f"\nuse in the last {window:g} s, by tenant:")
    emit_rows(tenants, fmt, ["tenant", "priority", "tokens", "input_tokens", "output_tokens",
                             "model_calls", "attempts"], empty="no model calls")
    return Exit.OK


# -- health ------------------------------------------------------------------------------

@dataclass
class Check:
    part: str
    address: str
    healthy: bool | None  # None: not set, so not checked
    reason: str
    elapsed_ms: float = 0.0


def _url_address(url: str) -> str:
    """A URL without its credentials, to show."""
    parsed = urlparse(url)
    if parsed.password or parsed.username:
        netloc = parsed.hostname or ""
        if parsed.port:
            netloc += f":{parsed.port}"
        parsed = parsed._replace(netloc=netloc)
    return urlunparse(parsed)


def _http_ok(url: str) -> str:
    """GET ``url``; the reason it is healthy, or raises with the reason it is not."""
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=KAFKA_TIMEOUT_SECONDS) as resp:  # noqa: S310
            return f"HTTP {resp.status} from {urlparse(url).path or '/'}"
    except urllib.error.HTTPError as exc:
        raise RuntimeError(f"HTTP {exc.code} from {urlparse(url).path}: "
                           f"{exc.read(300).decode('utf-8', 'replace').strip()}") from exc
    except urllib.error.URLError as exc:
        raise RuntimeError(str(exc.reason)) from exc


def _check_database(settings: Settings) -> str:
    from calmq.data.operations import probe

    server, schema = probe(settings.database_url, CONNECT_TIMEOUT_SECONDS)
    if schema is None:
        raise RuntimeError(f"PostgreSQL {server} answers but holds no calmq schema: run "
                           "`calmq migrate`")
    return f"PostgreSQL {server}, calmq schema version {schema}"


def _check_kafka(settings: Settings) -> str:
    from calmq import topics
    from calmq.kafka import connection_config

    _admin_client, metadata = open_admin(connection_config(settings))
    wanted = topics.all_topics([settings.pool], [t for t, _ in settings.retry_tier_list])
    missing = [t for t in wanted if t not in metadata.topics]
    if missing:
        raise RuntimeError(f"topics missing: {', '.join(missing)} (`calmq topics create`)")
    return f"{len(metadata.brokers)} broker(s), calmq's {len(wanted)} topics present"


def _check_registry(settings: Settings) -> str:
    """``GET /subjects`` with the settings' credentials and CA, as the services call it."""
    from calmq.codec import check_registry, registry_config

    subjects = check_registry(settings.schema_registry_url, registry_config(settings),
                              KAFKA_TIMEOUT_SECONDS)
    return f"{subjects} subject(s) registered"


def _check_object_store(settings: Settings) -> str:
    import os
    from pathlib import Path

    parsed = urlparse(settings.object_store_url)
    if parsed.scheme == "file":
        path = Path(parsed.path)
        if not path.is_dir():
            raise RuntimeError(f"{path} is not a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise RuntimeError(f"{path} is not writable by this user")
        return "directory present and writable"
    if parsed.scheme == "s3":
        import boto3
        from botocore.config import Config

        client = boto3.client("s3", config=Config(
            connect_timeout=KAFKA_TIMEOUT_SECONDS, read_timeout=KAFKA_TIMEOUT_SECONDS,
            retries={"max_attempts": 1}))
        client.head_bucket(Bucket=parsed.netloc)
        return f"bucket {parsed.netloc} answers"
    raise RuntimeError("neither file:///path nor s3://bucket/prefix")


def _checks(settings: Settings) -> list[tuple[str, str, str, Callable[[], str] | None]]:
    """(part, setting, address, check) for every part; no check when the setting is empty."""
    s = settings
    return [
        ("postgres", "database_url", database_address(s.database_url) if s.database_url else "",
         (lambda: _check_database(s)) if s.database_url else None),
        ("kafka", "kafka_bootstrap", s.kafka_bootstrap,
         (lambda: _check_kafka(s)) if s.kafka_bootstrap else None),
        ("schema-registry", "schema_registry_url", _url_address(s.schema_registry_url),
         (lambda: _check_registry(s)) if s.schema_registry_url else None),
        ("object-store", "object_store_url", _url_address(s.object_store_url),
         (lambda: _check_object_store(s)) if s.object_store_url else None),
        ("api", "api_url", _url_address(s.api_url),
         (lambda: _http_ok(s.api_url.rstrip("/") + "/readyz")) if s.api_url else None),
        ("fake-provider", "fake_provider_url", _url_address(s.fake_provider_url),
         (lambda: _http_ok(s.fake_provider_url.rstrip("/") + "/healthz"))
         if s.fake_provider_url else None),
        ("providers", "database_url", "provider_states",
         (lambda: _check_providers(s)) if s.database_url else None),
    ]


def _check_providers(settings: Settings) -> str:
    """The model providers as the fleet sees them: down while one is blocked (a bad key, a
    permission, a model, billing), with the reason (calmq.calls.gate)."""
    from calmq.data.providers import ProviderLedger

    async def read() -> list[Any]:
        async with open_store(settings, max_size=1) as store:
            return await ProviderLedger(store).states()

    states = asyncio.run(read())
    blocked = [p for p in states if p.blocked_reason]
    if blocked:
        raise CalmqError("; ".join(
            f"{p.provider.split(':', 1)[0]} {p.model} BLOCKED ({p.blocked_reason}) since "
            f"{p.blocked_at:%H:%M:%S}: {(p.blocked_message or '')[:120]}" for p in blocked),
            code="provider_blocked")
    paused = [f"{p.model} paused {p.paused_seconds:.1f} s" for p in states
              if p.paused_seconds > 0]
    return ", ".join(paused) or f"{len(states)} provider/model(s), none blocked"


# Every deployment has these; the others are optional (no registry: single-object Avro).
_REQUIRED = ("database_url", "kafka_bootstrap")


def _run_check(part: str, address: str, check: Callable[[], str]) -> Check:
    started = time.monotonic()
    try:
        reason, healthy = check(), True
    except CalmqError as exc:
        reason, healthy = exc.message, False
    except Exception as exc:  # noqa: BLE001 - any failure of a probe is the part's state
        text = str(exc).strip().splitlines()
        reason, healthy = (text[0] if text else type(exc).__name__), False
    return Check(part, address, healthy, reason, round((time.monotonic() - started) * 1000, 1))


def health(settings: Settings) -> list[Check]:
    """Every part the settings name, probed at once (each with its own few-second timeout)."""
    from concurrent.futures import ThreadPoolExecutor

    planned = _checks(settings)
    results: list[Check] = []
    with ThreadPoolExecutor(max_workers=len(planned)) as pool:
        futures = []
        for part, setting, address, check in planned:
            if check is None:
                required = setting in _REQUIRED
                results.append(Check(part, "", False if required else None,
                                     f"not set (CALMQ_{setting.upper()})"))
                continue
            futures.append(pool.submit(_run_check, part, address, check))
        results += [f.result() for f in futures]
    order = [p[0] for p in planned]
    return sorted(results, key=lambda c: order.index(c.part))


def cmd_health(args: argparse.Namespace) -> int:
    checks = health(settings_for(args))
    rows = [{**asdict(c), "status": "up" if c.healthy else ("not set" if c.healthy is None
                                                             else "DOWN")} for c in checks]
    emit_rows(rows, output_format(args), ["part", "status", "address", "elapsed_ms", "reason"])
    return Exit.OK if all(c.healthy is not False for c in checks) else Exit.ERROR


def register(command: Command, flags: Flags) -> None:
    option = flags.option
    p = command("lag", cmd_lag, "consumer lag per pool, topic and partition, with jobs in "
                "flight and the oldest waiting message's age", needs=("kafka_bootstrap",))
    option(p, "--pools", help="comma list of pools to show (default: every pool with topics)")
    add_output(p)
    p = command("budget", cmd_budget, "the shared token budget: limits, what is left and "
                "owed per priority, use per priority and tenant", needs=("database_url",))
    option(p, "--window", help="the window of use to sum: 90s, 5m, ... (default 60s, the "
           "provider's minute)")
    add_output(p)
    p = command("health", cmd_health, "probe every part the settings name (exit 1 if one "
                "is down)")
    add_output(p)
