"""The local stack and the tools around it: dev, demo, fake-provider, bench."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from calmq.cli.flags import Command, Flags, data_dir
from calmq.cli.output import add_output, emit_rows, output_format
from calmq.errors import ConfigError, UsageError

__all__ = ["register"]


def cmd_dev(args: argparse.Namespace) -> int:
    from calmq.tooling.devstack import SERVICES, Stack

    if args.action == "up":
        stack = Stack(data_dir(args), secure=bool(args.secure), brokers=int(args.brokers or 1),
                      standby=bool(args.standby), pooler=bool(args.pgbouncer))
    else:
        stack = Stack(data_dir(args))
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
        fmt = output_format(args)
        if fmt != "table":
            emit_rows(parts, fmt, [])
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


def cmd_demo(args: argparse.Namespace) -> int:
    from calmq.tooling.demo import run_demo

    return run_demo(data_dir(args), keep=args.keep)


def cmd_fake_provider(args: argparse.Namespace) -> int:
    from calmq.tooling.fake_provider import FakeProviderSettings, serve

    values = {
        "port": args.port, "latency_ms": args.latency_ms, "latency_dist": args.latency_dist,
        "requests_per_minute": args.requests_per_minute,
        "tokens_per_minute": args.tokens_per_minute, "slow_seconds": args.slow_seconds,
        "batch_completion_seconds": args.batch_completion_seconds,
        "retry_after_seconds": args.retry_after_seconds, "api_key": args.require_key,
        "check_requests": args.check_requests, "stream_ttft_ms": args.stream_ttft_ms,
        "stream_tokens_per_second": args.stream_tokens_per_second,
        "flex_latency_ms": args.flex_latency_ms, "flex_refusal_rate": args.flex_refusal_rate,
        "openai_automatic_cache": args.openai_automatic_cache,
    }
    try:
        settings = FakeProviderSettings(**{k: v for k, v in values.items() if v is not None})
    except ValidationError as exc:
        raise UsageError("; ".join(
            (f"--{'-'.join(map(str, e['loc'])).replace('_', '-')}: " if e["loc"] else "")
            + e["msg"].removeprefix("Value error, ") for e in exc.errors())) from exc
    from calmq.tooling.fake_provider.sdk_types import sdk_available

    if settings.check_requests and not sdk_available():
        # Without the SDKs every request would be answered 500 and every job would look like
        # an outage (upstream_unavailable): refuse to start, naming the fix.
        raise ConfigError(
            "the fake provider checks each request with the official openai and anthropic "
            "SDKs, which are not installed: pip install 'calmq[fake]' (or start it with "
            "--no-check-requests to accept requests unchecked)",
            code="fake_provider_sdks_missing")
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings))
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    """One scenario on its own throwaway stack; progress on stderr, the result on stdout."""
    # The benchmarks live in the source checkout, not in the wheel: found beside this package
    # (calmq/ is in the checkout's root), and handed on to the processes a scenario starts.
    checkout = Path(__file__).resolve().parents[2]
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
        if args.runs is not None and args.runs < 1:
            raise UsageError(f"--runs must be 1 or more, not {args.runs}")
        if args.size is not None and args.size < 1:
            raise UsageError(f"--size must be 1 or more, not {args.size}")
        size = int(args.size) if args.size else None
        steady = getattr(args, "steady_minutes", None)
        if steady is not None and steady <= 0:
            raise UsageError(f"--steady-minutes must be above 0, not {steady}")
        kw: dict[str, Any] = {} if steady is None else {"steady_seconds": steady * 60}
        if args.runs:
            kw["runs"] = int(args.runs)
        if getattr(args, "kill", None):
            if args.scenario != "fanout":
                raise UsageError("--kill is fanout's: kill -9 of the worker or the relay "
                                 "when half the children are done")
            kw["kill"] = args.kill
        result = run_scenario(args.scenario, size, **kw)
    except NotBuiltError as exc:
        print(f"benchmark scenario {args.scenario!r} is not built yet: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result) if args.json else text_table(result), flush=True)
    return 0


def _bench_options(command: Command, option: Callable[..., None]) -> None:
    """``calmq bench``: the scenarios (bench/scenarios.py) and their options."""
    p = command("bench", cmd_bench, "run a benchmark scenario")
    p.add_argument("scenario", choices=["accept", "relay", "e2e", "slow", "drain", "budget",
                                        "priority", "longcalls", "batch", "tiers",
                                        "logical_messages", "happy_path", "streaming",
                                        "scale", "fairness", "rerun", "bulk", "fanout"],
                   help="the scenario (docs/how-to/benchmarks.md)")
    option(p, "--size", type=int, help="jobs in the scenario (default: its own)")
    option(p, "--json", action="store_true", help="the result as one JSON object")
    option(p, "--runs", type=int,
           help="dispatch runs: e2e, this many (default 5; the median counts); scale, this "
                "many a database, in pairs (default 24)")
    option(p, "--kill", choices=["worker", "relay"],
           help="fanout: kill -9 this process when half the children are done, start it "
                "again, and report children lost, completed twice and joins fired")
    option(p, "--steady-minutes", type=float,
           help="scale: the steady run's length (default 30; 1 below a million jobs)")


def _tier_options(p: argparse.ArgumentParser, option: Callable[..., None]) -> None:
    """The fake provider's service tiers and prompt cache (docs/reference/fake-provider.md)."""
    option(p, "--flex-latency-ms", type=int,
           help="service_tier flex: its latency (default: four times the standard)")
    option(p, "--flex-refusal-rate", type=float,
           help="service_tier flex: the share of calls refused for capacity (default 0)")
    option(p, "--openai-automatic-cache", action="store_true", default=None,
           help="cache every OpenAI prompt (default: only those with prompt_cache_key)")


def register(command: Command, flags: Flags) -> None:
    option = flags.option
    p = command("dev", cmd_dev, "the local stack: up, down, status, env")
    p.add_argument("action", choices=["up", "down", "status", "env"],
                   help="start, stop, show or export the local stack")
    option(p, "--services", help="comma list of calmq services to start (default: all)")
    option(p, "--secure", action="store_true",
           help="up: the broker with only a SASL_SSL listener (SCRAM-SHA-512, a CA made at "
                "start) and the registry behind HTTPS with basic auth")
    option(p, "--brokers", type=int, choices=[1, 3],
           help="up: Kafka brokers (3: a KRaft cluster, topics with replication 3 and "
                "min.insync.replicas=2)")
    option(p, "--pgbouncer", action="store_true",
           help="up: PgBouncer in transaction mode in front of PostgreSQL, used by the API, "
                "workers, forwarder and CLI (the relay and LISTEN connect directly)")
    option(p, "--standby", action="store_true",
           help="up: a streaming PostgreSQL standby beside the primary, synchronising the "
                "relay's failover slot (promote it to try a failover)")
    option(p, "--json", action="store_true", help="status as JSON (the same as -o json)")
    add_output(p)

    p = command("demo", cmd_demo, "start the stack, run a handful of jobs, stop")
    option(p, "--keep", action="store_true", help="leave the stack running afterwards")

    p = command("fake-provider", cmd_fake_provider, "run the fake model provider")
    option(p, "--port", type=int, help="port to listen on")
    option(p, "--latency-ms", type=int, help="added latency of every call")
    option(p, "--latency-dist",
           help="latency distribution, e.g. lognormal:median=8s,p99=40s (replaces --latency-ms)")
    option(p, "--requests-per-minute", type=int, help="429 past this many requests a minute")
    option(p, "--tokens-per-minute", type=int, help="429 past this many tokens a minute")
    option(p, "--slow-seconds", type=float, help="how long mode `slow` sleeps")
    option(p, "--batch-completion-seconds", type=float,
           help="how long a batch runs before it ends (the batch APIs)")
    option(p, "--retry-after-seconds", type=float,
           help="the wait a 429 asks for (retry-after-ms and retry-after; default 1)")
    option(p, "--require-key", help="refuse calls without this key (401, as a real provider)")
    option(p, "--stream-ttft-ms", type=int,
           help="streamed answers: milliseconds before the first token (default 0)")
    option(p, "--stream-tokens-per-second", type=float,
           help="streamed answers: tokens a second after the first (default 0: at once)")
    _tier_options(p, option)
    option(p, "--check-requests", action=argparse.BooleanOptionalAction, default=None,
           help="check every request against the official SDKs' types and the providers' "
                "rules (default on)")

    _bench_options(command, option)
