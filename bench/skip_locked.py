"""Baseline: a plain PostgreSQL ``FOR UPDATE SKIP LOCKED`` queue doing the same job.

``serve``: an aiohttp endpoint that inserts one row per POST (what the team's API does).
``work``: N asyncio workers, each claiming one row per transaction, calling the same model
provider with the same request as calmq's summarize step, checking the answer is the summary
JSON, and marking the row completed. Run: ``python -m bench.skip_locked serve|work ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
from pathlib import Path
from typing import Any

import aiohttp
from aiohttp import web
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

__all__ = ["QUERIES", "call_model", "main"]


def _load(path: Path) -> dict[str, str]:
    queries: dict[str, str] = {}
    name = None
    for line in path.read_text().splitlines():
        if line.startswith("-- name:"):
            name = line.split(":", 1)[1].strip()
            queries[name] = ""
        elif name is not None and not line.startswith("--"):
            queries[name] += line + "\n"
    return queries


QUERIES = _load(Path(__file__).with_name("skip_locked.sql"))

_SYSTEM = (
    "Summarize the user's text in one or two sentences. Answer only with JSON: "
    '{"summary": string, "confidence": number between 0 and 1}.'
)


async def _serve(database_url: str, port: int, run: str) -> None:
    pool = AsyncConnectionPool(database_url, min_size=4, max_size=16, open=False,
                               kwargs={"autocommit": True})
    await pool.open()

    async def submit(request: web.Request) -> web.Response:
        body = json.loads(await request.read())
        if not isinstance(body, dict) or not isinstance(body.get("input"), dict):
            return web.json_response({"error": "input must be an object"}, status=422)
        async with pool.connection() as conn:
            cur = await conn.execute(QUERIES["insert"], {"run": run, "input": Jsonb(body["input"])})
            row = await cur.fetchone()
        assert row is not None
        return web.json_response({"id": row[0], "status": "queued"}, status=202)

    async def healthz(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app = web.Application()
    app.router.add_post("/jobs", submit)
    app.router.add_get("/healthz", healthz)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await runner.cleanup()
    await pool.close()


async def call_model(session: aiohttp.ClientSession, url: str, job_id: int,
                      data: dict[str, Any]) -> dict[str, Any] | None:
    body = {"model": "fake-small", "max_tokens": 256, "user": str(job_id), "messages": [
        {"role": "system", "content": _SYSTEM},
        {"role": "user", "content": json.dumps(data)}]}
    async with session.post(url + "/v1/chat/completions", json=body) as resp:
        if resp.status != 200:
            return None
        answer = await resp.json()
    try:
        out = json.loads(answer["choices"][0]["message"]["content"])
    except (KeyError, IndexError, TypeError, ValueError):
        return None
    return out if isinstance(out, dict) and isinstance(out.get("summary"), str) else None


async def _work(database_url: str, provider_url: str, workers: int, pool_size: int) -> None:
    pool = AsyncConnectionPool(database_url, min_size=min(4, pool_size), max_size=pool_size,
                               open=False, kwargs={"autocommit": True})
    await pool.open()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                    timeout=aiohttp.ClientTimeout(total=60))

    async def worker() -> None:
        idle = 0.005
        while not stop.is_set():
            async with pool.connection() as conn:  # one statement = one transaction
                cur = await conn.execute(QUERIES["claim"])
                row = await cur.fetchone()
            if row is None:
                await asyncio.sleep(idle)
                idle = min(idle * 2, 0.1)
                continue
            idle = 0.005
            job_id, data = row
            try:
                out = await call_model(session, provider_url, job_id, data)
            except (TimeoutError, aiohttp.ClientError):
                out = None
            async with pool.connection() as conn:
                if out is None:
                    await conn.execute(QUERIES["fail"], {"id": job_id})
                else:
                    await conn.execute(QUERIES["complete"], {"id": job_id, "result": Jsonb(out)})

    await asyncio.gather(*(worker() for _ in range(workers)))
    await session.close()
    await pool.close()


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.skip_locked")
    sub = parser.add_subparsers(dest="action", required=True)
    p = sub.add_parser("serve")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--run", default="bench")
    p = sub.add_parser("work")
    p.add_argument("--workers", type=int, default=64)
    p.add_argument("--pool-size", type=int, default=16)
    args = parser.parse_args()
    database_url = os.environ["CALMQ_DATABASE_URL"]
    if args.action == "serve":
        asyncio.run(_serve(database_url, args.port, args.run))
    else:
        asyncio.run(_work(database_url, os.environ["CALMQ_FAKE_PROVIDER_URL"], args.workers,
                          args.pool_size))


if __name__ == "__main__":
    main()
