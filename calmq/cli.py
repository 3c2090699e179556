"""The ``calmq`` command. Every flag also reads ``CALMQ_<FLAG>`` from the environment.

Settings that are empty (database, Kafka, registry, object store, API, fake provider) are
taken from the running local stack (`calmq dev up`), so a command started by hand joins it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Any, Literal, Union, get_args, get_origin

from calmq.errors import CalmqError, ConfigError

if TYPE_CHECKING:
    from calmq.settings import Settings

__all__ = ["main"]

_STACK_KEYS = ("database_url", "kafka_bootstrap", "schema_registry_url", "object_store_url",
               "api_url", "fake_provider_url")


# -- flags ------------------------------------------------------------------------------------
#
# A flag is either a setting or a command's own option. A setting's flag is made from its
# Settings field (name, type, help), and its CALMQ_ variable is read once, by Settings.load.
# An option (--json, --data-dir, --api-key, ...) reads its CALMQ_ variable itself, and the
# parser keeps the names of those variables so that Settings.load does not take one of them
# for a misspelt setting.

_TRUE = ("1", "true", "yes")


def _option_env(dest: str) -> str:
    from calmq.settings import ENV_PREFIX

    return ENV_PREFIX + dest.upper()


def _field_kind(name: str) -> dict[str, Any]:
    """The argparse type, choices or action of a Settings field, from its annotation."""
    from calmq.settings import Settings

    kind: Any = Settings.model_fields[name].annotation
    if get_origin(kind) in (Union, UnionType):  # an optional value: float | None
        kind = next(a for a in get_args(kind) if a is not type(None))
    if get_origin(kind) is Literal:
        return {"choices": list(get_args(kind))}
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if kind in (int, float):
        return {"type": kind}
    return {}  # strings, and what pydantic parses from a string (durations, JSON, secrets)


class _Flags:
    """Adds the commands' flags; remembers which CALMQ_ variables are options, not settings."""

    def __init__(self) -> None:
        self.option_env: set[str] = set()

    def setting(self, p: argparse.ArgumentParser, name: str, *aliases: str) -> None:
        """``--<name>`` for the Settings field ``name``: typed and described by the field."""
        from calmq.settings import ENV_PREFIX, Settings

        field = Settings.model_fields[name]
        default = "" if field.default in (None, "") else f"; default {field.default}"
        p.add_argument(
            "--" + name.replace("_", "-"), *aliases, dest=name, default=None,
            help=f"{field.description} [{ENV_PREFIX}{name.upper()}{default}]",
            **_field_kind(name),
        )

    def option(self, p: argparse.ArgumentParser, flag: str, *aliases: str,
               **kw: Any) -> None:
        """A command's own flag, which reads CALMQ_<DEST> (the flag wins over it)."""
        from calmq.settings import Settings

        action = p.add_argument(flag, *aliases, **kw)
        if action.dest in Settings.model_fields:
            raise ValueError(f"--{action.dest} is a setting: add it with _Flags.setting")
        env = _option_env(action.dest)
        action.help = f"{action.help or ''} [{env}]".lstrip()
        self.option_env.add(env)
        if env not in os.environ:
            return
        if kw.get("action") == "store_true":
            action.default = os.environ[env].lower() in _TRUE
        else:
            # argparse converts a string default with the flag's type, as if it were given.
            action.default = os.environ[env]


def _settings_environ(args: argparse.Namespace) -> dict[str, str]:
    """The environment without the options' CALMQ_ variables, which are no settings."""
    return {k: v for k, v in os.environ.items() if k not in args.option_env}


def _data_dir(args: argparse.Namespace) -> Path:
    from calmq.tooling.devstack import default_data_dir

    return Path(args.data_dir) if getattr(args, "data_dir", None) else default_data_dir()


def _settings(args: argparse.Namespace, **overrides: Any) -> Settings:
    """Settings from env + flags, with empty locations filled from the running local stack."""
    from calmq.settings import Settings
    from calmq.tooling.devstack import Stack

    flags = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    flags.update({k: v for k, v in overrides.items() if v is not None})
    state = Stack(_data_dir(args)).state()
    if state is not None:
        for key in _STACK_KEYS:
            env_key = "CALMQ_" + key.upper()
            if not flags.get(key) and not os.environ.get(env_key) and state.env.get(env_key):
                flags[key] = state.env[env_key]
    settings = Settings.load(flags, environ=_settings_environ(args))
    missing = [k for k in ("database_url", "kafka_bootstrap") if not getattr(settings, k)]
    if missing and getattr(args, "needs_stack", True):
        raise ConfigError(
            f"{', '.join('CALMQ_' + m.upper() for m in missing)} not set and no local stack is "
            "running: start one with `calmq dev up`, or `eval $(calmq dev env)`",
            code="no_stack",
        )
    return settings


def _logging(level: str = "INFO", redact: str = "*") -> None:
    from calmq.logs import configure

    configure(level, redact)  # one JSON object per line (docs/how-to/observability.md)
    # One line per schema-registry HTTP call is noise at INFO.
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)


# -- dev stack ------------------------------------------------------------------------------

def cmd_dev(args: argparse.Namespace) -> int:
    from calmq.tooling.devstack import SERVICES, Stack

    stack = Stack(_data_dir(args))
    if args.action == "up":
        wanted = args.services or ",".join(SERVICES)
        services = [s.strip() for s in wanted.split(",") if s.strip()]
        state = stack.up(services, log=lambda m: print(m, flush=True))
        print(f"calmq dev stack ready in {state.ready_seconds:.1f} s under {stack.data_dir}")
        print("versions: " + ", ".join(f"{k} {v}" for k, v in state.versions.items()))
        print(f"join it with: eval $(calmq dev env --data-dir {stack.data_dir})")
        return 0
    if args.action == "down":
        stopped = stack.down(log=lambda m: print(m, flush=True))
        print(f"stopped {len(stopped)} processes" if stopped else "nothing was running")
        return 0
    if args.action == "status":
        parts = stack.status()
        if args.json:
            print(json.dumps(parts, indent=2))
        elif not parts:
            print(f"no local stack under {stack.data_dir}")
        else:
            for p in parts:
                mark = "up  " if p["healthy"] else "DOWN"
                print(f"{mark} {p['name']:<16} pid {p['pid'] or '-':<8} {p['address']}")
        return 0 if parts and all(p["healthy"] for p in parts) else 1
    if args.action == "env":
        running = stack.state()
        if running is None:
            print(f"no local stack under {stack.data_dir}", file=sys.stderr)
            return 1
        for key, value in sorted(running.env.items()):
            print(f"export {key}={value}")
        return 0
    raise ConfigError(f"unknown dev action {args.action}")


# -- services -------------------------------------------------------------------------------

def cmd_api(args: argparse.Namespace) -> int:
    from aiohttp import web

    from calmq.data import Store
    from calmq.producers.api import build_app

    settings = _settings(args)
    _logging(settings.log_level, settings.log_redact_fields)

    _long_running()

    async def make() -> web.Application:
        store = Store(settings.database_url, max_size=16)
        await store.open()
        return build_app(settings, store)

    web.run_app(make(), host=settings.api_host, port=settings.api_port, print=None,
                access_log=None, handle_signals=True)
    return 0


def _long_running() -> None:
    """Garbage collection for a service process, called once its modules are loaded.

    perf on a worker at ~700 jobs/s: 12 % of its CPU in the cyclic collector, which kept
    walking the tens of thousands of objects every import leaves behind. Those are frozen
    (never scanned again), and the youngest generation is collected every 50,000
    allocations instead of 700; the few cycles a job makes wait a little longer.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(50_000, 20, 20)


def _metrics_server(port: int | None) -> None:
    if port:
        from prometheus_client import start_http_server

        start_http_server(int(port), addr="127.0.0.1")


def cmd_relay(args: argparse.Namespace) -> int:
    import signal

    from confluent_kafka import Producer

    from calmq.codec import make_codec
    from calmq.kafka import producer_config
    from calmq.relay import Publisher, drop_slot, make_relay

    settings = _settings(args)
    _logging(settings.log_level, settings.log_redact_fields)
    if args.drop_slot:
        dropped = drop_slot(settings.database_url, settings.relay_slot)
        print(f"dropped replication slot {settings.relay_slot}" if dropped
              else f"no replication slot {settings.relay_slot} in this database")
        return 0
    _metrics_server(args.metrics_port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    publisher = Publisher(Producer(producer_config(settings.kafka_bootstrap,
                                                  compression=settings.kafka_compression)),
                          make_codec(settings.schema_registry_url),
                          topic_replacement=settings.relay_topic_replacement)
    _long_running()
    make_relay(settings, publisher).run(stop)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from calmq.processors.worker import Worker

    settings = _settings(args)
    _logging(settings.log_level, settings.log_redact_fields)
    _metrics_server(args.metrics_port)
    _long_running()
    asyncio.run(Worker(settings).run())
    return 0


def cmd_forwarder(args: argparse.Namespace) -> int:
    import signal

    from confluent_kafka import Producer

    from calmq import topics
    from calmq.codec import make_codec
    from calmq.kafka import consumer_config, producer_config
    from calmq.processors.forwarder import Forwarder

    settings = _settings(args)
    _logging(settings.log_level, settings.log_redact_fields)
    _metrics_server(args.metrics_port)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    tier_topics = [topics.topic_for_route(topics.retry_route(t)) for t, _ in
                   settings.retry_tier_list]
    Forwarder(consumer_config(settings.kafka_bootstrap, "calmq.forwarder"),
              Producer(producer_config(settings.kafka_bootstrap,
                                       compression=settings.kafka_compression)),
              make_codec(settings.schema_registry_url), tier_topics,
              commit_interval=settings.commit_interval_ms / 1000).run(stop)
    return 0


def cmd_reaper(args: argparse.Namespace) -> int:
    from calmq.data import Store

    settings = _settings(args)
    _logging(settings.log_level, settings.log_redact_fields)

    async def loop() -> None:
        from calmq.objects import open_object_store
        from calmq.processors.reaper import schedule_reaper
        from calmq.reviews import ReviewDesk
        from calmq.supervision import Supervisor
        from calmq.workflows import load_workflows

        store = Store(settings.database_url, max_size=2)
        await store.open()
        # The review timer runs here too (and in every worker's housekeeping).
        desk = ReviewDesk(store, load_workflows(settings),
                          open_object_store(settings.object_store_url))
        side = Supervisor()
        schedule_reaper(side, store, desk, max(0.5, settings.lease_seconds / 3))
        try:
            await side.failed.wait()  # a failed pass is retried; a stopped task ends us
        finally:
            await side.stop()
            await store.close()
        raise SystemExit(1)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(loop())
    return 0


def cmd_fake_provider(args: argparse.Namespace) -> int:
    from calmq.tooling.fake_provider import FakeProviderSettings, serve

    values = {
        "port": args.port, "latency_ms": args.latency_ms,
        "requests_per_minute": args.requests_per_minute,
        "tokens_per_minute": args.tokens_per_minute, "slow_seconds": args.slow_seconds,
    }
    settings = FakeProviderSettings(**{k: v for k, v in values.items() if v is not None})
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings))
    return 0


# -- tenants, jobs --------------------------------------------------------------------------

def cmd_tenants(args: argparse.Namespace) -> int:
    from calmq.data import Store

    settings = _settings(args)

    async def create() -> str:
        store = Store(settings.database_url, max_size=1)
        await store.open()
        try:
            tenant, key = await store.tenants.create(args.name)
        finally:
            await store.close()
        print(f"tenant {tenant.name} created with id {tenant.id}; its API key (shown once):")
        return key

    if args.action != "create":
        from calmq.data import tenants

        if args.action == "add-key":
            print(f"a new API key for {args.name} (shown once):")
            print(tenants.add_key(settings.database_url, args.name))
        elif args.action == "revoke-key":
            revoked = tenants.revoke_keys(settings.database_url, args.name, args.key_prefix)
            print(f"revoked {len(revoked)} key(s) of {args.name}: {' '.join(revoked)}")
            return 0 if revoked else 1
        else:
            print(tenants.webhook_secret(settings.database_url, args.name))
        return 0
    print(asyncio.run(create()))
    return 0


def _http(method: str, url: str, key: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={  # noqa: S310
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - our own API
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")


def cmd_submit(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if not args.api_key:
        raise ConfigError("pass --api-key or set CALMQ_API_KEY", code="missing_api_key")
    data = json.loads(args.input) if args.input else {"text": args.text or "", "mode": args.mode}
    status, body = _http("POST", f"{settings.api_url}/v1/jobs", args.api_key, {
        "workflow": args.workflow, "input": {k: v for k, v in data.items() if v is not None},
        "priority": args.priority})
    print(json.dumps(body, indent=2))
    return 0 if status == 202 else 1


def cmd_status(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if not args.api_key:
        raise ConfigError("pass --api-key or set CALMQ_API_KEY", code="missing_api_key")
    status, body = _http("GET", f"{settings.api_url}/v1/jobs/{args.job_id}", args.api_key)
    print(json.dumps(body, indent=2))
    return 0 if status == 200 else 1


def cmd_topics(args: argparse.Namespace) -> int:
    from calmq import topics
    from calmq.kafka import create_topics

    settings = _settings(args)
    names = topics.all_topics([settings.pool], [t for t, _ in settings.retry_tier_list])
    created = create_topics(settings.kafka_bootstrap, names,
                            partitions=settings.topic_partitions,
                            replication=settings.topic_replication)
    for name in names:
        print(f"{'created' if name in created else 'exists '} {name}")
    return 0


def cmd_schemas(args: argparse.Namespace) -> int:
    from calmq.codec import RegistryCodec, SchemaStore

    if args.action == "check":
        from calmq.tooling.schemas_check import check_backward

        problems = check_backward(SchemaStore())
        for p in problems:
            print(p)
        print("every schema version reads the one before it" if not problems else
              f"{len(problems)} compatibility problem(s)")
        return 1 if problems else 0
    settings = _settings(args)
    if not settings.schema_registry_url:
        raise ConfigError("no schema registry: set CALMQ_SCHEMA_REGISTRY_URL",
                          code="no_schema_registry")
    ids = RegistryCodec(settings.schema_registry_url).register_all()
    for event_type, schema_id in ids.items():
        print(f"{event_type}: schema id {schema_id}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from calmq.tooling.demo import run_demo

    return run_demo(_data_dir(args), keep=args.keep)


def _when(text: str | None) -> Any:
    """``--since``/``--until``: an ISO time, or a duration ago (``90m``, ``2h``)."""
    from datetime import UTC, datetime, timedelta

    from calmq.settings import parse_duration

    if not text:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return datetime.now(UTC) - timedelta(seconds=parse_duration(text))
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _dlq_filter(args: argparse.Namespace) -> Any:
    from calmq.deadletters import DeadLetterFilter

    return DeadLetterFilter(
        failure_class=args.failure_class, code=args.code, workflow=args.workflow,
        tenant=args.tenant, since=_when(args.since), until=_when(args.until),
        limit=int(args.limit or 100),
    )


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def cmd_dlq(args: argparse.Namespace) -> int:
    import dataclasses
    import getpass
    import socket
    import uuid

    from calmq.data import Store
    from calmq.deadletters import DeadLetters
    from calmq.objects import open_object_store
    from calmq.workflows import load_workflows

    settings = _settings(args)

    def ids(values: list[str]) -> list[uuid.UUID]:
        try:
            return [uuid.UUID(v) for v in values]
        except ValueError:
            raise ConfigError(f"not a job id among {values}", code="invalid_job_id") from None

    async def run() -> int:
        store = Store(settings.database_url, max_size=2)
        await store.open()
        try:
            dlq = DeadLetters(store, workflows=load_workflows(settings),
                              objects=open_object_store(settings.object_store_url))
            if args.action == "list":
                rows = await dlq.find(_dlq_filter(args))
                if args.json:
                    print(json.dumps(_jsonable([dataclasses.asdict(r) for r in rows]), indent=2))
                for r in [] if args.json else rows:
                    err = r.error or {}
                    print(f"{r.id}  {r.dead_lettered_at:%Y-%m-%d %H:%M:%S}  "
                          f"{r.tenant:<16} {r.workflow}/{r.step}  "
                          f"{err.get('class', '?')}/{err.get('code', '?')}: "
                          f"{(err.get('message') or '')[:80]}")
                if not args.json:
                    print(f"{len(rows)} dead letter(s)")
                return 0
            if args.action == "show":
                if len(args.rest) != 1:
                    raise ConfigError("usage: calmq dlq show JOB_ID", code="usage")
                job = await dlq.show(ids(args.rest)[0])
                print(json.dumps(_jsonable(job), indent=2))
                return 0
            # redrive: the given ids, or every dead letter the filters match
            where = _dlq_filter(args)
            if not args.rest and not any(v is not None for k, v in where.params().items()
                                         if k != "limit"):
                raise ConfigError("name job ids or at least one filter (--code, --since, ...); "
                                  "a bare redrive would requeue every dead letter",
                                  code="redrive_needs_target")
            targets = ids(args.rest) if args.rest else [r.id for r in await dlq.find(where)]
            if not args.reason:
                raise ConfigError("say why with --reason (it goes into the job's history)",
                                  code="redrive_needs_reason")
            who = args.by or f"{getpass.getuser()}@{socket.gethostname()}"
            outcomes = await dlq.redrive(targets, by=who, reason=args.reason,
                                         dry_run=args.dry_run,
                                         rate=float(args.rate) if args.rate else None)
            for o in outcomes:
                print(json.dumps(o.as_dict()) if args.json else
                      f"{o.job_id}  {o.outcome:<13} {o.code or ''} {o.message}".rstrip())
            counts = {k: sum(o.outcome == k for o in outcomes)
                      for k in ("redriven", "would_redrive", "skipped", "rejected")}
            if not args.json:
                print(", ".join(f"{v} {k}" for k, v in counts.items() if v) or "nothing to do")
            return 1 if counts["rejected"] else 0
        finally:
            await store.close()

    return asyncio.run(run())


def cmd_keda(args: argparse.Namespace) -> int:
    from calmq.settings import Settings
    from calmq.tooling.keda import write

    # Not _settings(): a running local stack's 127.0.0.1 addresses must not leak into
    # manifests for a cluster. Empty addresses render as the in-cluster service names.
    flags = {"concurrency": args.concurrency, "keda_pools": args.keda_pools}
    settings = Settings.load(flags, environ=_settings_environ(args))
    for path in write(settings, Path(args.output_dir or "deploy/keda")):
        print(f"wrote {path}")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """One scenario on its own throwaway stack; progress on stderr, the result on stdout."""
    # The benchmarks live in the source checkout, not in the wheel: found beside this package
    # (calmq/ is in the checkout's root), and handed on to the processes a scenario starts.
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "bench" / "__init__.py").is_file():
        sys.path.insert(0, str(checkout))
        os.environ["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(checkout), os.environ.get("PYTHONPATH")) if p)
    try:
        from bench import NotBuiltError, run_scenario, text_table
    except ImportError as exc:
        print(f"calmq bench needs the bench package (a source checkout): {exc}", file=sys.stderr)
        return 2
    try:
        result = run_scenario(args.scenario, int(args.size) if args.size else None)
    except NotBuiltError as exc:
        print(f"benchmark scenario {args.scenario!r} is not built yet: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else text_table(result), flush=True)
    return 0


# -- parser ---------------------------------------------------------------------------------

def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("calmq")
    except PackageNotFoundError:  # run from a checkout that was never installed
        from calmq import __version__

        return __version__


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="calmq", description=__doc__)
    root.add_argument("--version", action="version", version=f"calmq {_version()}")
    sub = root.add_subparsers(dest="command", required=True)
    flags = _Flags()
    setting, option = flags.setting, flags.option

    def command(name: str, fn: Callable[[argparse.Namespace], int], help_: str,
                stack: bool = True) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_)
        p.set_defaults(fn=fn, needs_stack=stack)
        option(p, "--data-dir", help="the local stack's folder (default: a per-user temp dir)")
        return p

    p = command("dev", cmd_dev, "the local stack: up, down, status, env", stack=False)
    p.add_argument("action", choices=["up", "down", "status", "env"])
    option(p, "--services", help="comma list of calmq services to start (default: all)")
    option(p, "--json", action="store_true", help="status as JSON")

    p = command("demo", cmd_demo, "start the stack, run a handful of jobs, stop", stack=False)
    option(p, "--keep", action="store_true", help="leave the stack running afterwards")

    p = command("api", cmd_api, "run the intake API")
    setting(p, "api_port")
    setting(p, "api_host")
    p = command("relay", cmd_relay, "run the outbox relay")
    option(p, "--metrics-port", type=int)
    setting(p, "relay_mode", "--mode")
    setting(p, "relay_slot")
    # No CALMQ_ variable: an exported one would drop the slot at every start.
    p.add_argument("--drop-slot", action="store_true",
                   help="remove the relay's replication slot on purpose, then exit")
    p = command("worker", cmd_worker, "run a stream processor")
    setting(p, "pool")
    setting(p, "priorities")
    setting(p, "concurrency")
    option(p, "--metrics-port", type=int)
    setting(p, "step_timeout_seconds")
    setting(p, "max_attempts")
    p = command("forwarder", cmd_forwarder, "retry-tier forwarder: republish retries when due")
    option(p, "--metrics-port", type=int)
    command("reaper", cmd_reaper, "requeue jobs whose lease expired")
    p = command("fake-provider", cmd_fake_provider, "run the fake model provider", stack=False)
    option(p, "--port", type=int)
    option(p, "--latency-ms", type=int)
    option(p, "--requests-per-minute", type=int)
    option(p, "--tokens-per-minute", type=int)
    option(p, "--slow-seconds", type=float)

    p = command("tenants", cmd_tenants, "manage tenants")
    p.add_argument("action", choices=["create", "add-key", "revoke-key", "webhook-secret"])
    p.add_argument("name")
    option(p, "--key-prefix", help="revoke-key: only the key starting so (12 chars)")
    p = command("submit", cmd_submit, "submit a job through the API")
    option(p, "--api-key")
    option(p, "--workflow", default="summarize")
    option(p, "--priority", default="interactive", choices=["interactive", "bulk"])
    option(p, "--text")
    option(p, "--mode")
    option(p, "--input", help="the whole input as JSON")
    p = command("status", cmd_status, "show a job")
    option(p, "--api-key")
    p.add_argument("job_id")
    p = command("dlq", cmd_dlq, "dead letters: list, show, redrive")
    p.add_argument("action", choices=["list", "show", "redrive"])
    p.add_argument("rest", nargs="*", help="job ids (show: one; redrive: none means the filter)")
    option(p, "--failure-class", help="transient, input, permission, policy, verifier, ...")
    option(p, "--code", help="the error code, e.g. malformed_output")
    option(p, "--workflow")
    option(p, "--tenant", help="tenant name")
    option(p, "--since", help="dead-lettered at or after: ISO time or a duration ago (2h)")
    option(p, "--until", help="dead-lettered before: ISO time or a duration ago")
    option(p, "--limit", type=int, help="at most this many (default 100)")
    option(p, "--reason", help="redrive: why (recorded in the history)")
    option(p, "--by", help="redrive: who (default user@host)")
    option(p, "--rate", type=float, help="redrive: at most this many jobs per second")
    option(p, "--dry-run", action="store_true",
           help="redrive: say what would happen, write nothing")
    option(p, "--json", action="store_true")
    p = command("topics", cmd_topics, "create calmq's topics")
    p.add_argument("action", choices=["create"])
    setting(p, "pool")
    p = command("schemas", cmd_schemas, "register or check the Avro schemas", stack=False)
    p.add_argument("action", choices=["register", "check"])
    p = command("keda", cmd_keda, "render KEDA manifests", stack=False)
    p.add_argument("action", choices=["render"])
    option(p, "--output-dir", help="where to write (default deploy/keda)")
    setting(p, "concurrency")
    setting(p, "keda_pools")
    p = command("bench", cmd_bench, "run a benchmark scenario", stack=False)
    p.add_argument("scenario", choices=["accept", "relay", "e2e", "slow", "drain", "budget"])
    option(p, "--size", type=int)
    option(p, "--json", action="store_true")
    root.set_defaults(option_env=frozenset(flags.option_env))
    return root


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.fn(args)
        return code
    except CalmqError as exc:
        print(f"calmq: error [{exc.code}]: {exc.message}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
