"""The provider adapters, measured: calmq's hand-written aiohttp adapter (option b) against
the official ``openai`` SDK's ``AsyncOpenAI`` on its aiohttp transport (option a), with many
calls in flight against the same fake provider (fixed latency), each in a process of its
own. What ``longcalls`` needs of an adapter: the calls per second it sustains against the
ideal (in flight / latency), its memory with every call open, its CPU per call and how late
its event loop runs. The decision and its figures: docs/explanation/decisions.md.

    python -m bench.provider_adapters [--calls N] [--in-flight N] [--latency-ms MS] [--json]

Never part of the test run; ratios are calmq's adapter / the SDK's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = {"type": "object", "title": "SummaryOutput",
          "properties": {"summary": {"type": "string"}, "confidence": {"type": "number"}},
          "required": ["summary"]}


async def _drive(variant: str, url: str, calls: int, in_flight: int) -> dict[str, Any]:
    messages = [{"role": "system", "content": "Summarize the user's text."},
                {"role": "user", "content": json.dumps({"text": "queues and retries " * 20})}]
    if variant == "calmq":
        from calmq.calls.wires import open_provider

        provider = open_provider("openai", url, "k", "fake-small")

        async def call(n: int) -> None:
            await provider.complete(messages=messages, job_id=f"job-{n}", max_tokens=64,
                                    response_schema=SCHEMA)

        async def close() -> None:
            await provider.close()
    else:
        import httpx2
        from openai import AsyncOpenAI, DefaultAioHttpClient

        from calmq.calls.wires.openai import openai_strict_schema

        strict = openai_strict_schema(SCHEMA)
        client = AsyncOpenAI(
            base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=600,
            http_client=DefaultAioHttpClient(limits=httpx2.Limits(
                max_connections=in_flight * 2, max_keepalive_connections=in_flight * 2)))

        async def call(n: int) -> None:
            await client.chat.completions.create(
                model="fake-small", messages=messages, max_completion_tokens=64,  # type: ignore[arg-type]
                user=f"job-{n}", response_format={"type": "json_schema", "json_schema": {
                    "name": "SummaryOutput", "schema": strict, "strict": True}})

        async def close() -> None:
            await client.close()

    lags: list[float] = []
    stop = asyncio.Event()

    async def ticker() -> None:  # the worker's own loop-lag measure (calmq_event_loop_lag)
        loop = asyncio.get_running_loop()
        while not stop.is_set():
            tick = loop.time()
            await asyncio.sleep(0.1)
            lags.append(max(0.0, loop.time() - tick - 0.1))

    gate = asyncio.Semaphore(in_flight)
    done = 0

    async def one(n: int) -> None:
        nonlocal done
        async with gate:
            await call(n)
            done += 1

    tick_task = asyncio.create_task(ticker())
    cpu0 = time.process_time()
    started = time.monotonic()
    await asyncio.gather(*(one(n) for n in range(calls)))
    elapsed = time.monotonic() - started
    cpu = time.process_time() - cpu0
    stop.set()
    await tick_task
    await close()
    lags.sort()
    return {"calls": done, "seconds": round(elapsed, 2),
            "calls_per_s": round(done / elapsed, 1),
            "cpu_ms_per_call": round(cpu * 1000 / done, 3),
            "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "loop_lag_p99_ms": round(lags[int(len(lags) * 0.99)] * 1000, 1) if lags else 0.0}


def _fake(latency_ms: int) -> tuple[subprocess.Popen[bytes], str]:
    from calmq.tooling.devstack import processes

    port = processes.free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "calmq.cli", "fake-provider", "--port", str(port),
         "--latency-ms", str(latency_ms), "--no-check-requests"],
        cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url + "/healthz", timeout=1):
                return proc, url
        except OSError:
            time.sleep(0.2)  # poll: the fake is starting
    proc.kill()
    raise RuntimeError("the fake provider did not start")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="bench.provider_adapters")
    parser.add_argument("--calls", type=int, default=20_000)
    parser.add_argument("--in-flight", type=int, default=5000)
    parser.add_argument("--latency-ms", type=int, default=2000)
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--variant", choices=["calmq", "sdk"], help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.variant:  # one variant, in this process
        print(json.dumps(asyncio.run(_drive(args.variant, args.url, args.calls,
                                            args.in_flight))))
        return 0
    proc, url = _fake(args.latency_ms)
    figures: dict[str, Any] = {}
    try:
        for variant in ("calmq", "sdk"):
            out = subprocess.run(
                [sys.executable, "-m", "bench.provider_adapters", "--variant", variant,
                 "--url", url, "--calls", str(args.calls), "--in-flight",
                 str(args.in_flight)], cwd=ROOT, capture_output=True, text=True, check=True)
            figures[variant] = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    ideal = args.in_flight / (args.latency_ms / 1000)
    for variant in figures.values():
        variant["calls_per_s_vs_ideal"] = round(variant["calls_per_s"] / ideal, 3)
    result = {"scenario": "provider_adapters", "size": args.calls,
              "in_flight": args.in_flight, "latency_ms": args.latency_ms,
              "ideal_calls_per_s": ideal, "figures": figures,
              "ratios": {k: round(figures["calmq"][k] / figures["sdk"][k], 3)
                         for k in ("calls_per_s", "cpu_ms_per_call", "peak_rss_mb")
                         if figures["sdk"][k]}}
    print(json.dumps(result, indent=None if args.json else 2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
