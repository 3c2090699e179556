"""The HTTP load generator: aiohttp, closed loop (N connections) or open loop (fixed rate).

It runs in the bench process, on the same 2 cores as everything it measures; its name and
mode go into every result so a reader knows what pushed the load.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

__all__ = ["NAME", "LoadResult", "closed_loop", "open_loop", "percentile"]

NAME = f"bench.loadgen (aiohttp {aiohttp.__version__}, in-process)"


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, math.ceil(q / 100 * len(ordered)) - 1))
    return ordered[rank]


@dataclass
class LoadResult:
    sent: int = 0
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    started_at: float = 0.0  # wall clock (time.time) of the first request
    elapsed_s: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.ok / self.elapsed_s if self.elapsed_s > 0 else 0.0

    def error_summary(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in sorted(self.errors.items())) or "none"


async def _one(session: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str],
               result: LoadResult, expect: int) -> None:
    t0 = time.perf_counter()
    result.sent += 1
    try:
        async with session.post(url, data=body, headers=headers) as resp:
            await resp.read()
            status = resp.status
    except (TimeoutError, aiohttp.ClientError) as exc:
        key = type(exc).__name__
        result.errors[key] = result.errors.get(key, 0) + 1
        return
    if status == expect:
        result.ok += 1
        result.latencies_ms.append((time.perf_counter() - t0) * 1000)
    else:
        result.errors[str(status)] = result.errors.get(str(status), 0) + 1


def _session(limit: int) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(
        connector=aiohttp.TCPConnector(limit=limit),
        timeout=aiohttp.ClientTimeout(total=60),
    )


async def closed_loop(url: str, body: dict[str, Any], headers: dict[str, str], *, total: int,
                      concurrency: int = 64, expect: int = 202) -> LoadResult:
    """``total`` POSTs from ``concurrency`` connections, each sending as soon as it is answered."""
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **headers}
    result = LoadResult()
    remaining = total

    async with _session(concurrency) as session:
        async def lane() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                await _one(session, url, data, headers, result, expect)

        result.started_at = time.time()
        t0 = time.perf_counter()
        await asyncio.gather(*(lane() for _ in range(concurrency)))
        result.elapsed_s = time.perf_counter() - t0
    return result


async def open_loop(url: str, body: dict[str, Any], headers: dict[str, str], *, rate: float,
                    seconds: float, expect: int = 202, max_outstanding: int = 512) -> LoadResult:
    """POSTs on a fixed schedule (``rate`` per second), whether or not earlier ones answered."""
    data = json.dumps(body).encode()
    headers = {"Content-Type": "application/json", **headers}
    result = LoadResult()
    total = int(rate * seconds)
    tasks: set[asyncio.Task[None]] = set()
    async with _session(max_outstanding) as session:
        result.started_at = time.time()
        t0 = time.perf_counter()
        for i in range(total):
            delay = t0 + i / rate - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            task = asyncio.create_task(_one(session, url, data, headers, result, expect))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)
        result.elapsed_s = time.perf_counter() - t0
    return result
