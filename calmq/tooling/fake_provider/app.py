"""The fake provider's HTTP routes, and how it is served and started.

Routes in each provider's shape: OpenAI (``/v1/...``), Azure OpenAI (the v1 API under
``/openai/v1/...`` and deployment URLs ``/openai/deployments/{name}/...?api-version=``),
OpenAI-compatible servers (the OpenAI paths) and Anthropic (``/v1/messages...``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence

from aiohttp import web

from calmq.tooling.fake_provider import conformance
from calmq.tooling.fake_provider.batches import BatchApis
from calmq.tooling.fake_provider.online import Online
from calmq.tooling.fake_provider.settings import MODES, FakeProviderSettings

__all__ = ["build_app", "main", "serve"]

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _azure_deployment(handler: Handler) -> Handler:
    """Azure's deployment URLs need ``api-version`` (a 404 without, as Azure answers)."""
    async def handle(request: web.Request) -> web.StreamResponse:
        if not request.query.get("api-version"):
            return web.json_response({"error": {
                "code": "404", "message": "Resource not found: the api-version query "
                "parameter is required on deployment URLs"}}, status=404)
        return await handler(request)

    return handle


def build_app(
    settings: FakeProviderSettings, *, clock: Callable[[], float] = time.monotonic
) -> web.Application:
    """The fake provider as an aiohttp app; ``clock`` only drives the rate-limit window."""
    if settings.check_requests:
        conformance.start_warming()
    online = Online(settings, clock)
    # Prompts in tests can be large; the 1 MiB aiohttp default would turn them into 413s.
    app = web.Application(client_max_size=16 * 1024 * 1024)
    for prefix in ("/v1", "/openai/v1"):  # OpenAI (and compatible servers); Azure's v1 API
        app.router.add_post(f"{prefix}/chat/completions", online.handle_openai)
        app.router.add_post(f"{prefix}/embeddings", online.handle_embeddings)
    deployment = "/openai/deployments/{deployment}"
    app.router.add_post(f"{deployment}/chat/completions", _azure_deployment(online.handle_openai))
    app.router.add_post(f"{deployment}/embeddings", _azure_deployment(online.handle_embeddings))
    app.router.add_post("/v1/messages", online.handle_anthropic)
    app.router.add_get("/stats", online.handle_stats)
    app.router.add_get("/admin/calls", online.handle_calls)
    app.router.add_get("/admin/streams", online.handle_streams)
    app.router.add_post("/admin/reset", online.handle_reset)
    app.router.add_post("/admin/mode", online.handle_mode)
    app.router.add_post("/admin/outage", online.handle_outage)
    app.router.add_post("/admin/flaky", online.handle_flaky)
    app.router.add_get("/healthz", online.handle_healthz)
    BatchApis(settings, online.record_refusal, online.batch_call_denied).routes(app)
    return app


async def serve(
    settings: FakeProviderSettings, *, on_ready: Callable[[str], None] | None = None
) -> None:
    """Serve until cancelled; ``on_ready`` gets the base URL (real port when port=0)."""
    # access_log=None: a log line per request would dominate the cost of an answer.
    runner = web.AppRunner(build_app(settings), access_log=None, handle_signals=False)
    await runner.setup()
    try:
        site = web.TCPSite(runner, settings.host, settings.port, backlog=1024)
        await site.start()
        port = settings.port
        for address in runner.addresses:
            if isinstance(address, tuple):
                port = int(address[1])
                break
        url = f"http://{settings.host}:{port}"
        print(f"fake-provider listening on {url}", flush=True)
        if on_ready is not None:
            on_ready(url)
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main(argv: Sequence[str] | None = None) -> None:
    """Command line entry: ``python -m calmq.tooling.fake_provider --port 8090``."""
    parser = argparse.ArgumentParser(prog="calmq.tooling.fake_provider",
                                     description="The fake paid model provider.")
    defaults = FakeProviderSettings()
    parser.add_argument("--host", default=defaults.host)
    parser.add_argument("--port", type=int, default=defaults.port)
    parser.add_argument("--requests-per-minute", type=int, default=0)
    parser.add_argument("--tokens-per-minute", type=int, default=0)
    parser.add_argument("--slow-seconds", type=float, default=defaults.slow_seconds)
    parser.add_argument("--retry-after-seconds", type=float, default=defaults.retry_after_seconds)
    parser.add_argument("--low-confidence", type=float, default=defaults.low_confidence)
    parser.add_argument("--latency-ms", type=int, default=0)
    parser.add_argument("--latency-dist", default="",
                        help="e.g. lognormal:median=8s,p99=40s (replaces --latency-ms)")
    parser.add_argument("--mode-override", choices=sorted(MODES), default=None)
    parser.add_argument("--batch-completion-seconds", type=float,
                        default=defaults.batch_completion_seconds)
    parser.add_argument("--stream-ttft-ms", type=int, default=0,
                        help="streamed answers: milliseconds before the first token")
    parser.add_argument("--stream-tokens-per-second", type=float, default=0.0,
                        help="streamed answers: tokens a second after the first (0: at once)")
    parser.add_argument("--api-key", default="",
                        help="refuse calls without this key (401, as a real provider)")
    parser.add_argument("--flex-latency-ms", type=int, default=None,
                        help="service_tier flex: its latency (default: 4x the standard)")
    parser.add_argument("--flex-refusal-rate", type=float, default=0.0,
                        help="service_tier flex: the share of calls refused for capacity")
    parser.add_argument("--openai-automatic-cache", action="store_true",
                        help="cache every OpenAI prompt (default: those with prompt_cache_key)")
    parser.add_argument("--no-check-requests", dest="check_requests", action="store_false",
                        help="do not check requests against the SDK types and strict rules")
    args = parser.parse_args(argv)
    settings = FakeProviderSettings(**vars(args))
    # Ctrl-C is the normal way to stop it; a traceback would read like a crash.
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings))

