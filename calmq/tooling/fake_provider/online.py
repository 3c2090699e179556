"""The online endpoints: Chat Completions, Messages and embeddings, the per-job modes, the
failure set, the rate limits, and the admin and stats endpoints.

Every request is first checked as the real API would (``conformance``): what it refuses is
answered with its error body and counted in ``/stats`` as ``refused``, so a test can assert
that calmq sent nothing a real provider would have refused. Then the job's mode (or an
outage, or the rate limit) picks the answer.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Final

from aiohttp import web

from calmq.tooling.fake_provider import conformance, modes
from calmq.tooling.fake_provider.admin import Admin
from calmq.tooling.fake_provider.calls import (
    BadRequest,
    Call,
    format_seconds,
    parse_call,
    tokens_of,
    vector,
)
from calmq.tooling.fake_provider.events import (
    AnthropicEvents,
    OpenAIEvents,
    anthropic_input,
    anthropic_type,
)
from calmq.tooling.fake_provider.failures import (
    FAILURES,
    Failure,
    anthropic_body,
    openai_body,
)
from calmq.tooling.fake_provider.limits import SlidingWindow, limit_headers
from calmq.tooling.fake_provider.settings import MODES, FakeProviderSettings
from calmq.tooling.fake_provider.tiers import (
    FLEX_REFUSAL,
    Caching,
    FlexShare,
    openai_served_tier,
)
from calmq.tooling.latency import parse_latency

__all__ = ["BATCH_HEADER", "Online"]

BATCH_HEADER: Final = "X-Calmq-Fake-Batch"
_JSON: Final = "application/json"
_KEPT_STREAMS: Final = 5_000
_KEPT_CALLS: Final = 20_000  # /admin/calls: the latest calls' arrival times
_KEPT_REFUSALS: Final = 50


class Online(Admin):
    """All mutable state of the online endpoints; handlers are its bound methods."""

    def __init__(self, settings: FakeProviderSettings, clock: Callable[[], float]) -> None:
        self._settings = settings
        dist = parse_latency(settings.latency_dist or f"fixed:{settings.latency_ms}")
        self._latency_dist, self._latency_rng = dist, dist.sampler()
        self.mode_override = settings.mode_override
        self._limiter = (
            SlidingWindow(settings.requests_per_minute, settings.tokens_per_minute, clock)
            if settings.requests_per_minute or settings.tokens_per_minute
            else None
        )
        self._ids = itertools.count(1)
        self.calls = 0
        self.in_flight = 0
        self.in_flight_max = 0
        self._status_counts: dict[int, int] = {}
        self._by_job: dict[str, list[int]] = {}  # job id -> [calls, completed]
        self._flaky_attempts: dict[str, int] = {}
        # POST /admin/outage: until this monotonic time every model call fails with the
        # failures in turn (a provider-wide incident, whatever each job's mode says).
        self._outage_until = 0.0
        self._outage: tuple[str, ...] = ()
        self._outage_calls = itertools.count()
        # POST /admin/flaky: embeddings calls with an input holding the text fail (503) so
        # many more times (an embeddings call carries no step input to choose a mode by).
        self._embed_flaky: dict[str, int] = {}
        # An outage of one model only (None: every model), and its own Retry-After (None:
        # the setting's): a model's cooldown while the provider's other models answer.
        self._outage_model: str | None = None
        self._outage_retry_after: float | None = None
        self.refused = 0
        self._refusals: deque[str] = deque(maxlen=_KEPT_REFUSALS)
        # (wall time, path, job, model, auth scheme, extra header names) per call.
        self._arrivals: deque[tuple[float, str, str, str, str, list[str]]] = deque(
            maxlen=_KEPT_CALLS)
        # Streamed answers: job, arrival, first token and end (wall times), tokens, broken.
        self._streams: deque[dict[str, Any]] = deque(maxlen=_KEPT_STREAMS)
        # Service tiers and prompt caching (tiers.py): calls answered per served tier, flex
        # calls refused for capacity, and the prompt tokens read from / written to a cache.
        self._flex = FlexShare(settings.flex_refusal_rate)
        self._caching = Caching(openai_automatic=settings.openai_automatic_cache)
        self._by_tier: dict[str, int] = {}
        self.flex_refused = 0
        self.cached_input_tokens = 0
        self.cache_written_tokens = 0
        # The usage this provider would bill, per job and model: [prompt tokens (all of
        # them), read from the cache, written to it, completion tokens] (/stats "billed").
        self._billed: dict[str, dict[str, list[int]]] = {}

    @property
    def _latency(self) -> float:
        """This call's latency in seconds: one draw from the distribution per answer."""
        return self._latency_dist.draw(self._latency_rng)

    # --- responses -------------------------------------------------------------------

    def _respond(
        self, status: int, payload: dict[str, Any], headers: dict[str, str] | None = None
    ) -> web.Response:
        self._status_counts[status] = self._status_counts.get(status, 0) + 1
        return web.Response(
            status=status,
            body=json.dumps(payload, separators=(",", ":")).encode(),
            content_type=_JSON,
            headers=headers,
        )

    def _fail(self, anthropic: bool, failure: Failure, *, model: str = "",
              headers: dict[str, str] | None = None, **fields: str) -> web.Response:
        if anthropic:
            status, payload = anthropic_body(failure, f"req_fake_{next(self._ids)}",
                                             model=model, **fields)
        else:
            status, payload = openai_body(failure, model=model, **fields)
        return self._respond(status, payload, headers)

    def batch_call_denied(self, request: web.Request, anthropic: bool) -> web.Response | None:
        """A batch API call (files, batches) as the real API answers one without the key or
        during an outage: the same refusal as a model call; None when it is served."""
        _scheme, denied = self._credentials(request, anthropic)
        if denied:
            return self._fail(anthropic, FAILURES[denied])
        if self._in_outage(""):  # a one-model outage leaves the batch APIs alone
            kind = self._outage[next(self._outage_calls) % len(self._outage)]
            return self._outage_failure(anthropic, kind, "")
        return None

    def record_refusal(self, message: str) -> None:
        self.refused += 1
        self._refusals.append(message)

    def _refuse(self, anthropic: bool, refusal: conformance.Refusal) -> web.Response:
        """A request the real API refuses, answered with its error body."""
        self.record_refusal(refusal.message)
        if anthropic:
            payload: dict[str, Any] = {
                "type": "error", "error": {"type": refusal.kind, "message": refusal.message},
                "request_id": f"req_fake_{next(self._ids)}"}
        else:
            payload = {"error": {"message": refusal.message, "type": refusal.kind,
                                 "param": refusal.param, "code": refusal.code}}
        return self._respond(refusal.status, payload)

    def _error(self, anthropic: bool, status: int, *, kind: str, code: str, message: str,
               headers: dict[str, str] | None = None) -> web.Response:
        if anthropic:
            payload: dict[str, Any] = {
                "type": "error", "error": {"type": anthropic_type(status), "message": message}}
        else:
            payload = {"error": {"message": message, "type": kind, "code": code, "param": None}}
        return self._respond(status, payload, headers)

    def _answer(self, call: Call, content: str, *, refusal: bool,
                headers: dict[str, str] | None) -> web.Response:
        completion_tokens = len(tokens_of(call, content)) if call.draft \
            else max(1, len(content) // 4)
        number = next(self._ids)
        if call.anthropic:
            payload: dict[str, Any] = {
                "id": f"msg_fake_{number}", "type": "message", "role": "assistant",
                "model": call.model, "content": [{"type": "text", "text": content}],
                "stop_reason": "refusal" if refusal else "end_turn", "stop_sequence": None,
                "usage": {**anthropic_input(call), "output_tokens": completion_tokens,
                          "service_tier": "standard"},
            }
        else:
            message: dict[str, Any] = (
                {"role": "assistant", "content": None, "refusal": content}
                if refusal
                else {"role": "assistant", "content": content, "refusal": None}
            )
            payload = {
                "id": f"chatcmpl-fake-{number}", "object": "chat.completion",
                "created": int(time.time()), "model": call.model,
                "service_tier": call.served_tier,
                "choices": [
                    {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}
                ],
                "usage": {
                    "prompt_tokens": call.prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": call.prompt_tokens + completion_tokens,
                    "prompt_tokens_details": {"cached_tokens": call.cached_tokens},
                    "completion_tokens_details": {"reasoning_tokens": 0},
                },
            }
        self._served(call, completion_tokens)
        return self._respond(200, payload, headers)

    def _served(self, call: Call, output_tokens: int) -> None:
        """Count an answered call under its served tier and its cached input, and its usage
        under its job and model (/stats)."""
        tier = "standard" if call.anthropic else call.served_tier
        self._by_tier[tier] = self._by_tier.get(tier, 0) + 1
        self.cached_input_tokens += call.cached_tokens
        self.cache_written_tokens += call.cache_written_tokens
        billed = self._billed.setdefault(call.job_id, {}).setdefault(call.model, [0, 0, 0, 0])
        for n, tokens in enumerate((call.prompt_tokens, call.cached_tokens,
                                    call.cache_written_tokens, output_tokens)):
            billed[n] += tokens

    def _tiered(self, call: Call, body: dict[str, Any]) -> web.Response | None:
        """Set the call's served tier and cached input; the refusal of a flex call that
        finds no capacity (OpenAI's 429 Resource Unavailable), or None."""
        cached = self._caching.anthropic(body) if call.anthropic else self._caching.openai(body)
        call.cached_tokens, call.cache_written_tokens = cached.read, cached.written
        call.cache_prefixes = cached.prefixes
        if call.anthropic:
            return None
        call.served_tier = openai_served_tier(body)
        if call.served_tier == "flex" and self._flex.refuse():
            self.flex_refused += 1
            return self._respond(429, {"error": dict(FLEX_REFUSAL)})
        return None

    def _call_latency(self, call: Call) -> float:
        """The latency of this call's tier: flex its own (the setting, or four times the
        standard draw); every other tier the standard one."""
        if call.served_tier != "flex":
            return self._latency
        flex_ms = self._settings.flex_latency_ms
        return flex_ms / 1000 if flex_ms is not None else 4 * self._latency

    def _limit_headers(self, anthropic: bool) -> dict[str, str]:
        assert self._limiter is not None
        requests_left, tokens_left = self._limiter.remaining()
        return limit_headers(anthropic=anthropic, rpm=self._settings.requests_per_minute,
                             tpm=self._settings.tokens_per_minute,
                             requests_left=requests_left, tokens_left=tokens_left)

    # --- checks as the real API makes them ----------------------------------------------

    def _credentials(self, request: web.Request, anthropic: bool) -> tuple[str, str | None]:
        """The auth scheme the call used, and the refusal when the fake has a key set and
        the call did not carry it (OpenAI: Bearer; Azure: api-key; Anthropic: x-api-key)."""
        bearer = request.headers.get("Authorization", "")
        if request.headers.get("api-key"):
            scheme, key = "api-key", request.headers["api-key"]
        elif request.headers.get("x-api-key"):
            scheme, key = "x-api-key", request.headers["x-api-key"]
        elif bearer.startswith("Bearer "):
            scheme, key = "bearer", bearer.removeprefix("Bearer ")
        else:
            scheme, key = "none", ""
        wanted = self._settings.api_key
        if wanted and key != wanted:
            return scheme, "unauthorized"
        if anthropic and wanted and scheme != "x-api-key":
            return scheme, "unauthorized"
        return scheme, None

    def _arrive(self, request: web.Request, body: Any, scheme: str) -> None:
        extra = sorted(h for h in request.headers if h.lower().startswith("x-")
                       and h.lower() not in ("x-api-key", BATCH_HEADER.lower()))
        model: Any = ""
        job: Any = ""
        if isinstance(body, dict):
            model = body.get("model") or ""
            meta = body.get("metadata")
            job = body.get("user") or (meta.get("user_id") if isinstance(meta, dict) else "")
        self._arrivals.append((time.time(), request.path, str(job or ""), str(model), scheme,
                               extra))

    # --- model endpoints -------------------------------------------------------------

    async def handle_openai(self, request: web.Request) -> web.StreamResponse:
        return await self._counted(request, anthropic=False)

    async def handle_anthropic(self, request: web.Request) -> web.StreamResponse:
        return await self._counted(request, anthropic=True)

    async def _counted(self, request: web.Request, *, anthropic: bool) -> web.StreamResponse:
        # Calls open at once, and the most there were (/stats): what a fleet's slots let
        # through, seen from the provider's side.
        self.in_flight += 1
        self.in_flight_max = max(self.in_flight_max, self.in_flight)
        try:
            return await self._handle(request, anthropic=anthropic)
        finally:
            self.in_flight -= 1

    async def _handle(self, request: web.Request, *, anthropic: bool) -> web.StreamResponse:
        """One model call, in steps: read and check it, count it under its job, an outage or
        a flex refusal, its mode, the rate limit, the mode's failure, then the answer."""
        self.calls += 1
        read = await self._read(request, anthropic)
        if isinstance(read, web.Response):
            return read
        call, body = read
        job_stats = self._count_job(call)

        if self._in_outage(call.model):
            return await self._outage_answer(call)
        refused = self._tiered(call, body)
        if refused is not None:
            return refused
        mode = self.mode_override or call.mode
        if mode not in MODES:
            await self._sleep(self._latency)
            return self._error(
                anthropic, 400, kind="invalid_request_error", code="unknown_mode",
                message=f"unknown mode {mode!r}; expected one of {', '.join(sorted(MODES))}")

        content = modes.content(mode, call, self._settings)
        headers, limited = await self._rate_limit(request, call, content, anthropic)
        if limited is not None:
            return limited
        failing, breaking = self._counted_failure(mode, call)

        if not (failing or mode in ("always_fail", "rate_limited", "timeout", "invalid_line")
                or mode in FAILURES):
            # A call that will be answered puts its prefix in the cache now, so the calls
            # that arrive after it read it; a refused or failing one puts nothing there.
            self._caching.keep(call.cache_prefixes)
        delay = self._call_latency(call) + call.delay_seconds
        await self._sleep(delay + modes.extra_delay(mode, self._settings))

        failed = self._mode_failure(mode, call, anthropic, failing=failing, headers=headers)
        if failed is not None:
            return failed
        assert content is not None
        if job_stats is not None and mode in modes.VALID_RESULT_MODES and not breaking:
            job_stats[1] += 1
        if call.stream:
            return await self._stream(request, call, content, refusal=mode == "refusal",
                                      headers=headers,
                                      breaking=mode if breaking else None)
        if mode == "truncated":
            return await self._truncated(request, call, content)
        return self._answer(call, content, refusal=mode == "refusal", headers=headers)

    async def _read(self, request: web.Request,
                    anthropic: bool) -> tuple[Call, Any] | web.Response:
        """The call and its body, checked as the real API checks them; or the answer that
        refuses it (bad JSON, a wrong key, a request the real API refuses, a bad field)."""
        try:
            body = json.loads(await request.read())
        except ValueError:
            await self._sleep(self._latency)
            return self._error(anthropic, 400, kind="invalid_request_error",
                               code="invalid_request", message="invalid JSON")
        scheme, denied = self._credentials(request, anthropic)
        self._arrive(request, body, scheme)
        if denied:
            return self._fail(anthropic, FAILURES[denied])
        if self._settings.check_requests:
            await conformance.ready()
            refusal = self._check(request, body, anthropic)
            if refusal is not None:
                return self._refuse(anthropic, refusal)
        try:
            call = parse_call(body, request, anthropic=anthropic)
        except BadRequest as bad:
            await self._sleep(self._latency)
            return self._error(anthropic, 400, kind="invalid_request_error", code=bad.code,
                               message=bad.message)
        return call, body

    def _count_job(self, call: Call) -> list[int] | None:
        """The call counted under its job (/stats by_job: [calls, completed]); None without
        a job."""
        job_stats: list[int] | None = None
        if call.job_id:
            job_stats = self._by_job.get(call.job_id)
            if job_stats is None:
                job_stats = self._by_job[call.job_id] = [0, 0]
            job_stats[0] += 1
        return job_stats

    async def _rate_limit(self, request: web.Request, call: Call, content: str | None,
                          anthropic: bool
                          ) -> tuple[dict[str, str] | None, web.Response | None]:
        """The rate limit's headers, and its 429 when the call is over the limit."""
        headers: dict[str, str] | None = None
        # A batch's requests do not count against the online limits (as at OpenAI).
        if self._limiter is None or BATCH_HEADER in request.headers:
            return headers, None
        settings = self._settings
        completion = call.max_tokens or (max(1, len(content) // 4) if content else 1)
        verdict = self._limiter.admit(call.prompt_tokens + completion)
        headers = self._limit_headers(anthropic)
        if verdict.admitted:
            return headers, None
        retry_after = max(1, math.ceil(verdict.retry_after))
        headers["Retry-After"] = str(retry_after)
        if not anthropic:
            headers["retry-after-ms"] = str(max(1, math.ceil(verdict.retry_after
                                                             * 1000)))
        if verdict.too_large:
            message = (
                f"Request too large: limit {settings.tokens_per_minute} tokens per"
                f" minute, requested {call.prompt_tokens + completion}"
            )
        else:
            message = f"Rate limit reached for {verdict.limited_by} per minute"
        await self._sleep(self._latency)
        return headers, self._error(anthropic, 429, kind=verdict.limited_by,
                                    code="rate_limit_exceeded", message=message,
                                    headers=headers)

    def _counted_failure(self, mode: str, call: Call) -> tuple[bool, bool]:
        """Whether this call of a ``flaky`` job fails, and whether this streamed call of a
        ``stream_break`` or ``stream_error`` job breaks off: the first ``fail_times`` calls
        of the job do."""
        failing = False
        if mode in modes.COUNTED_MODES:
            # Counted on arrival, so concurrent attempts of one job fail in arrival order.
            attempts = self._flaky_attempts.get(call.job_id, 0)
            self._flaky_attempts[call.job_id] = attempts + 1
            failing = attempts < call.fail_times
        breaking = failing and mode in ("stream_break", "stream_error") and call.stream
        return failing and mode == "flaky", breaking

    def _mode_failure(self, mode: str, call: Call, anthropic: bool, *, failing: bool,
                      headers: dict[str, str] | None) -> web.Response | None:
        """The failure the mode answers with (a failing ``flaky`` call's too); None when the
        call is answered."""
        settings = self._settings
        if mode == "always_fail" or failing:
            return self._fail(anthropic, FAILURES["always_fail"], headers=headers)
        if mode == "rate_limited":
            limited = dict(headers) if headers else {}
            seconds = settings.retry_after_seconds
            limited["Retry-After"] = format_seconds(seconds)
            if not anthropic:
                limited["retry-after-ms"] = str(round(seconds * 1000))
            return self._fail(anthropic, FAILURES["rate_limited"], headers=limited,
                              seconds=format_seconds(seconds))
        if mode in FAILURES or mode == "invalid_line":
            return self._fail(anthropic, FAILURES.get(mode, FAILURES["bad_request"]),
                              model=call.model, headers=headers)
        return None

    async def _stream(self, request: web.Request, call: Call, content: str, *, refusal: bool,
                      headers: dict[str, str] | None,
                      breaking: str | None) -> web.StreamResponse:
        """A streamed answer in the provider's own events, token by token: OpenAI's
        ``chat.completion.chunk`` objects (the usage in a last chunk with no choices when
        ``stream_options.include_usage`` asked for it) and ``data: [DONE]``; Anthropic's
        ``message_start``, ``content_block_start``, ``ping``, ``content_block_delta``,
        ``content_block_stop``, ``message_delta``, ``message_stop``. ``breaking``
        (``stream_break``: the connection is cut; ``stream_error``: the provider's error
        event) ends it half way."""
        settings = self._settings
        tokens = tokens_of(call, content)
        stop = "end_turn" if call.anthropic else "stop"
        if call.max_tokens is not None and len(tokens) > call.max_tokens:
            tokens = tokens[: call.max_tokens]
            stop = "max_tokens" if call.anthropic else "length"
        if refusal:
            stop = "refusal" if call.anthropic else "stop"
        number = next(self._ids)
        record: dict[str, Any] = {"job": call.job_id, "at": time.time(), "first_token_at": None,
                                  "ended_at": None, "tokens": 0, "broken": breaking}
        self._streams.append(record)
        self._status_counts[200] = self._status_counts.get(200, 0) + 1
        self._served(call, len(tokens))
        resp = web.StreamResponse(status=200, headers={
            "Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
            **(headers or {})})
        await resp.prepare(request)
        writer = (AnthropicEvents(call, number) if call.anthropic
                  else OpenAIEvents(call, number, refusal=refusal))
        await resp.write(writer.start())
        ttft = call.ttft_seconds if call.ttft_seconds is not None \
            else settings.stream_ttft_ms / 1000
        rate = call.tokens_per_second or settings.stream_tokens_per_second
        await self._sleep(ttft)
        loop = asyncio.get_running_loop()
        began = loop.time()
        half = len(tokens) // 2
        for n, token in enumerate(tokens):
            if rate:
                await self._sleep(began + n / rate - loop.time())
            if breaking is not None and n == max(1, half):
                record["ended_at"] = time.time()
                if breaking == "stream_error":
                    await resp.write(writer.error())
                    await resp.write_eof()
                    return resp
                transport = request.transport
                if transport is not None:  # cut: no last event, no end of the chunked body
                    transport.close()
                return resp
            await resp.write(writer.delta(token))
            if n == 0:
                record["first_token_at"] = time.time()
            record["tokens"] = n + 1
        await resp.write(writer.end(stop, len(tokens)))
        record["ended_at"] = time.time()
        await resp.write_eof()
        return resp

    def _check(self, request: web.Request, body: Any,
               anthropic: bool) -> conformance.Refusal | None:
        if anthropic:
            if not request.headers.get("anthropic-version"):
                return conformance.Refusal(400, "anthropic-version: header is required")
            return conformance.anthropic_messages(body)
        return conformance.openai_chat(body)

    async def _truncated(self, request: web.Request, call: Call,
                         content: str) -> web.StreamResponse:
        """A 200 whose body stops half way: the connection closes before Content-Length."""
        full = self._answer(call, content, refusal=False, headers=None)
        data = bytes(full.body) if isinstance(full.body, bytes | bytearray) else b"{}"
        resp = web.StreamResponse(status=200, headers={"Content-Type": _JSON})
        resp.content_length = len(data)
        await resp.prepare(request)
        await resp.write(data[: len(data) // 2])
        transport = request.transport
        if transport is not None:
            transport.close()
        return resp

    async def handle_embeddings(self, request: web.Request) -> web.Response:
        """OpenAI-shaped embeddings: a deterministic unit vector per input, from its hash."""
        self.calls += 1
        try:
            body = json.loads(await request.read())
        except ValueError:
            body = None
        scheme, denied = self._credentials(request, False)
        self._arrive(request, body, scheme)
        if denied:
            return self._fail(False, FAILURES[denied])
        if self._settings.check_requests:
            await conformance.ready()
            refusal = conformance.openai_embeddings(body)
            if refusal is not None:
                return self._refuse(False, refusal)
        try:
            raw = body["input"]
            inputs = [raw] if isinstance(raw, str) else list(raw)
        except (KeyError, TypeError):
            inputs = []
        if not inputs or not all(isinstance(i, str) for i in inputs):
            return self._error(False, 400, kind="invalid_request_error", code="invalid_input",
                               message="'input' must be a string or a non-empty array of strings")
        assert isinstance(body, dict)
        job_id = body.get("user") if isinstance(body.get("user"), str) else ""
        if job_id:
            stats = self._by_job.setdefault(job_id, [0, 0])
            stats[0] += 1
            stats[1] += 1
        marker = next((m for m, left in self._embed_flaky.items()
                       if left > 0 and any(m in i for i in inputs)), None)
        if marker is not None:  # POST /admin/flaky: this call fails, as an outage's 503
            self._embed_flaky[marker] -= 1
            if job_id:
                self._by_job[job_id][1] -= 1
            await self._sleep(self._latency)
            return self._fail(False, FAILURES["always_fail"])
        if self._in_outage(str(body.get("model", ""))):
            kind = self._outage[next(self._outage_calls) % len(self._outage)]
            return self._outage_failure(False, kind, str(body.get("model", "")))
        await self._sleep(self._latency)
        tokens = sum(max(1, len(i) // 4) for i in inputs)
        headers = self._limit_headers(False) if self._limiter is not None else None
        return self._respond(200, {
            "object": "list",
            "model": body.get("model", ""),
            "data": [{"object": "embedding", "index": n, "embedding": vector(text)}
                     for n, text in enumerate(inputs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        }, headers)

    def _in_outage(self, model: str) -> bool:
        return (bool(self._outage) and time.monotonic() < self._outage_until
                and self._outage_model in (None, model))

    async def _outage_answer(self, call: Call) -> web.Response:
        await self._sleep(self._latency)
        kind = self._outage[next(self._outage_calls) % len(self._outage)]
        return self._outage_failure(call.anthropic, kind, call.model)

    def _outage_failure(self, anthropic: bool, kind: str, model: str) -> web.Response:
        if kind == "rate_limited":
            seconds = (self._outage_retry_after if self._outage_retry_after is not None
                       else self._settings.retry_after_seconds)
            headers = {"Retry-After": format_seconds(seconds)}
            if not anthropic:
                headers["retry-after-ms"] = str(round(seconds * 1000))
            return self._error(anthropic, 429, kind="requests", code="rate_limit_exceeded",
                               message="Rate limit reached (simulated outage)", headers=headers)
        if kind == "server_error":
            return self._error(anthropic, 500, kind="server_error", code="outage",
                               message="The server had an error (simulated outage)")
        if kind == "always_fail":
            return self._error(anthropic, 503, kind="server_error", code="outage",
                               message="The server had an error (simulated outage)")
        return self._fail(anthropic, FAILURES[kind], model=model)

    @staticmethod
    async def _sleep(seconds: float) -> None:
        # Skipping the zero sleep keeps the common benchmark path free of a loop round-trip.
        if seconds > 0:
            await asyncio.sleep(seconds)
