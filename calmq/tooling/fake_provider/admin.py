"""The fake's admin and stats endpoints: ``/stats`` and ``/admin/calls`` and ``/admin/streams``
(what arrived and how it was answered), ``/admin/reset``, and the switches a test flips:
``/admin/mode``, ``/admin/outage``, ``/admin/flaky``."""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any, Final

from aiohttp import web

from calmq.tooling.fake_provider.failures import OUTAGE_KINDS
from calmq.tooling.fake_provider.limits import SlidingWindow
from calmq.tooling.fake_provider.settings import MODES
from calmq.tooling.fake_provider.tiers import Caching

__all__ = ["Admin"]

_BILLED: Final = ("input_tokens", "cached_input_tokens", "cache_creation_input_tokens",
                  "output_tokens")


class Admin:
    """The admin and stats handlers, mixed into ``Online``: they read, reset and switch the
    state its ``__init__`` sets (declared here for the type checker)."""

    calls: int
    in_flight: int
    in_flight_max: int
    mode_override: str | None
    refused: int
    flex_refused: int
    cached_input_tokens: int
    cache_written_tokens: int
    _status_counts: dict[int, int]
    _by_job: dict[str, list[int]]
    _flaky_attempts: dict[str, int]
    _embed_flaky: dict[str, int]
    _refusals: deque[str]
    _arrivals: deque[tuple[float, str, str, str, str, list[str]]]
    _streams: deque[dict[str, Any]]
    _by_tier: dict[str, int]
    _billed: dict[str, dict[str, list[int]]]
    _caching: Caching
    _limiter: SlidingWindow | None
    _outage: tuple[str, ...]
    _outage_until: float
    _outage_model: str | None
    _outage_retry_after: float | None


    async def handle_stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "calls": self.calls,
                "in_flight": self.in_flight,
                "in_flight_max": self.in_flight_max,
                "status_counts": {str(k): v for k, v in self._status_counts.items()},
                "by_job": {
                    job: {"calls": stats[0], "completed": stats[1]}
                    for job, stats in self._by_job.items()
                },
                "mode_override": self.mode_override,
                "refused": self.refused,
                "refusals": list(self._refusals),
                "by_tier": dict(self._by_tier),
                "flex_refused": self.flex_refused,
                "cached_input_tokens": self.cached_input_tokens,
                "cache_creation_input_tokens": self.cache_written_tokens,
                # What each job's answered calls would be billed for, per model: input
                # tokens (the cached and written ones included), of them read from and
                # written to the cache, and output tokens.
                "billed": {job: {model: dict(zip(_BILLED, usage, strict=True))
                                 for model, usage in models.items()}
                           for job, models in self._billed.items()},
            }
        )

    async def handle_calls(self, request: web.Request) -> web.Response:
        """GET /admin/calls: each recent model call's arrival (wall time), path, job, model,
        auth scheme and the names of its extra ``X-`` headers."""
        return web.json_response({"calls": [
            {"at": at, "path": path, "job": job, "model": model, "auth": scheme,
             "headers": extra}
            for at, path, job, model, scheme, extra in self._arrivals]})

    async def handle_streams(self, request: web.Request) -> web.Response:
        """GET /admin/streams: each recent streamed answer's job, arrival, first token and
        end (Unix seconds, as this server wrote them), tokens sent and how it broke off."""
        return web.json_response({"streams": list(self._streams)})

    async def handle_reset(self, request: web.Request) -> web.Response:
        self.calls = 0
        self.in_flight_max = self.in_flight
        self._status_counts.clear()
        self._by_job.clear()
        self._flaky_attempts.clear()
        self._embed_flaky.clear()
        self.refused = 0
        self._refusals.clear()
        self._arrivals.clear()
        self._streams.clear()
        self._by_tier.clear()
        self.flex_refused = self.cached_input_tokens = self.cache_written_tokens = 0
        self._billed.clear()
        self._caching.clear()
        if self._limiter is not None:
            self._limiter.reset()
        return web.json_response({"ok": True})

    async def handle_mode(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except ValueError:
            body = None
        if not isinstance(body, dict) or "mode" not in body:
            return web.json_response(
                {"error": 'body must be {"mode": "<mode>" | null}'}, status=400
            )
        mode = body["mode"]
        if mode is not None and mode not in MODES:
            return web.json_response(
                {"error": f"unknown mode {mode!r}; expected one of {sorted(MODES)} or null"},
                status=400,
            )
        self.mode_override = mode
        return web.json_response({"mode_override": mode})

    async def handle_outage(self, request: web.Request) -> web.Response:
        """``{"seconds": 20, "statuses": [500, 429]}``: every call fails for that long, with
        each status in turn (429 Retry-After, 500, 503, 529 overloaded, 401 bad key, 403,
        404 model, or "insufficient_quota" / "context_length_exceeded"). Optional: ``model``
        (only calls to that model fail: one model's cooldown) and ``retry_after_seconds``
        (the 429s' Retry-After; default: the setting)."""
        try:
            body = json.loads(await request.read())
        except ValueError:
            body = None
        seconds = body.get("seconds") if isinstance(body, dict) else None
        statuses = body.get("statuses", [500, 429]) if isinstance(body, dict) else None
        known = sorted(OUTAGE_KINDS, key=str)
        if (isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0
                or not isinstance(statuses, list) or not statuses
                or not all(not isinstance(s, bool) and s in OUTAGE_KINDS for s in statuses)):
            return web.json_response(
                {"error": f'body must be {{"seconds": >= 0, "statuses": [one of {known}]}}'},
                status=400)
        model = body.get("model")
        retry_after = body.get("retry_after_seconds")
        if model is not None and (not isinstance(model, str) or not model):
            return web.json_response({"error": "model must be a model name (a string)"},
                                     status=400)
        if retry_after is not None and (isinstance(retry_after, bool)
                                        or not isinstance(retry_after, int | float)
                                        or retry_after < 0):
            return web.json_response({"error": "retry_after_seconds must be a number >= 0"},
                                     status=400)
        self._outage = tuple(OUTAGE_KINDS[s] for s in statuses)
        self._outage_until = time.monotonic() + float(seconds)
        self._outage_model = model
        self._outage_retry_after = None if retry_after is None else float(retry_after)
        return web.json_response({"seconds": seconds, "statuses": statuses, "model": model})

    async def handle_flaky(self, request: web.Request) -> web.Response:
        """``{"contains": "text", "times": 2}``: the next ``times`` embeddings calls with an
        input that contains the text fail with a 503, as the ``flaky`` mode's calls do (one
        batch of a document failing transiently); each counts as a call, not completed."""
        try:
            body = json.loads(await request.read())
        except ValueError:
            body = None
        text = body.get("contains") if isinstance(body, dict) else None
        times = body.get("times", 2) if isinstance(body, dict) else None
        if (not isinstance(text, str) or not text or isinstance(times, bool)
                or not isinstance(times, int) or times < 0):
            return web.json_response({"error": 'body must be {"contains": text, "times": >= 0}'},
                                     status=400)
        self._embed_flaky[text] = times
        return web.json_response({"contains": text, "times": times})

    async def handle_healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})
