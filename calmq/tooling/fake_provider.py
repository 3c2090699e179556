"""Fake paid model provider: a real HTTP server speaking the OpenAI and Anthropic shapes.

Tests, the demo and benchmarks point calmq at this server instead of a paid API, so every
failure a real provider shows (5xx, 429, refusals, prose instead of JSON, slowness) can be
triggered deterministically, per job, from the step input itself. The step input is the
JSON object in the last user message, e.g. ``{"text": "...", "mode": "flaky",
"fail_times": 2, "delay_ms": 0}``.

It sits on the hot path of benchmarks, so a request costs a JSON parse, a few dict updates
and one ``asyncio.sleep`` at most: no validation models, no per-request logging.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import itertools
import json
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, NamedTuple

from aiohttp import BodyPartReader, web
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from calmq.tooling.latency import parse_latency

__all__ = ["MODES", "FakeProviderSettings", "build_app", "main", "serve"]

MODES: Final[frozenset[str]] = frozenset(
    {
        "success",
        "slow",
        "malformed",
        "always_fail",
        "flaky",
        "rate_limited",
        "low_confidence",
        "refusal",
        "bad_request",
        "unauthorized",
    }
)

_SUCCESS_CONFIDENCE: Final = 0.97
_SUMMARY_WORDS: Final = 12
_MALFORMED_TEXT: Final = "Sorry, here is a summary without JSON"
_REFUSAL_TEXT: Final = "I can't help with that"
_DEFAULT_FAIL_TIMES: Final = 2
_WINDOW_SECONDS: Final = 60.0
# Compacting the window lists only once the dead prefix is large keeps expiry O(1)
# amortised without a per-request list shift.
_COMPACT_AT: Final = 4096
_JOB_HEADER: Final = "X-Calmq-Job-Id"
_JSON: Final = "application/json"
# Modes whose 200 answer carries a result that satisfies the summary schema.
_VALID_RESULT_MODES: Final = frozenset({"success", "slow", "flaky", "low_confidence"})


class FakeProviderSettings(BaseModel):
    """How the fake provider behaves; every knob a test or benchmark needs to turn."""

    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(default=8090, ge=0, le=65535)
    requests_per_minute: int = Field(default=0, ge=0)  # 0 = unlimited
    tokens_per_minute: int = Field(default=0, ge=0)  # 0 = unlimited
    # Past the summarize step's 60 s timeout (the dev stack's default, no worker override):
    # a slow job times out on `calmq dev up` as it starts, as the reference table says.
    slow_seconds: float = Field(default=90.0, ge=0)
    retry_after_seconds: float = Field(default=1.0, ge=0)
    low_confidence: float = Field(default=0.42, ge=0, le=1)
    latency_ms: int = Field(default=0, ge=0)
    # A latency distribution (calmq/tooling/latency.py), e.g. lognormal:median=8s,p99=40s;
    # replaces latency_ms, so real calls' spread can be benchmarked, not only a fixed time.
    latency_dist: str = ""
    mode_override: str | None = None
    # The batch APIs: seconds from a batch's creation until it ends (POST /admin/batches).
    batch_completion_seconds: float = Field(default=2.0, ge=0)

    @field_validator("latency_dist")
    @classmethod
    def _known_latency(cls, value: str) -> str:
        if value:
            parse_latency(value)
        return value

    @model_validator(mode="after")
    def _one_latency(self) -> FakeProviderSettings:
        if self.latency_dist and self.latency_ms:
            raise ValueError("set --latency-ms or --latency-dist (latency_ms or latency_dist),"
                             " not both")
        return self

    @field_validator("mode_override")
    @classmethod
    def _known_mode(cls, value: str | None) -> str | None:
        if value is not None and value not in MODES:
            raise ValueError(f"unknown mode {value!r}; expected one of {sorted(MODES)}")
        return value


class _BadRequestError(Exception):
    """The request itself is unusable; answered with 400 invalid_request_error."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(slots=True)
class _Call:
    anthropic: bool
    model: str
    job_id: str
    mode: str
    text: str
    fail_times: int
    delay_seconds: float
    prompt_tokens: int
    max_tokens: int | None
    # The system prompt asks for invoice fields (calmq/workflows/invoice.py): answer those.
    invoice: bool = False


class _Verdict(NamedTuple):
    admitted: bool
    retry_after: float
    limited_by: str  # "requests" or "tokens": OpenAI's error type for a 429
    too_large: bool


class _SlidingWindow:
    """Requests and tokens admitted over the last 60 s.

    Entries live in two parallel lists (time, cumulative tokens) read from ``_head``; a
    running cumulative sum turns "tokens in the window" into one subtraction and "when will
    enough tokens free up" into one bisect, so neither admission nor rejection walks the
    window.
    """

    __slots__ = ("_base", "_clock", "_cum", "_head", "_rpm", "_times", "_total", "_tpm")

    def __init__(self, rpm: int, tpm: int, clock: Callable[[], float]) -> None:
        self._rpm = rpm
        self._tpm = tpm
        self._clock = clock
        self._times: list[float] = []
        self._cum: list[int] = []
        self._head = 0
        self._base = 0  # cumulative tokens of everything already expired
        self._total = 0  # cumulative tokens of everything ever admitted

    def reset(self) -> None:
        self._times.clear()
        self._cum.clear()
        self._head = 0
        self._base = 0
        self._total = 0

    def _expire(self, now: float) -> None:
        cutoff = now - _WINDOW_SECONDS
        times, head = self._times, self._head
        end = len(times)
        while head < end and times[head] <= cutoff:
            head += 1
        if head != self._head:
            self._base = self._cum[head - 1]
            if head >= _COMPACT_AT and head * 2 >= end:
                del times[:head]
                del self._cum[:head]
                head = 0
            self._head = head

    def remaining(self) -> tuple[int, int]:
        """Requests and tokens still available right now (after the last admission)."""
        self._expire(self._clock())
        used_requests = len(self._times) - self._head
        used_tokens = self._total - self._base
        return max(0, self._rpm - used_requests), max(0, self._tpm - used_tokens)

    def admit(self, cost: int) -> _Verdict:
        now = self._clock()
        self._expire(now)
        head = self._head
        count = len(self._times) - head
        wait = 0.0
        limited_by = "requests"
        if self._rpm and count >= self._rpm:
            # The (count - rpm + 1)-th oldest entry must expire before one more fits.
            wait = self._times[head + count - self._rpm] + _WINDOW_SECONDS - now
        if self._tpm:
            if cost > self._tpm:
                return _Verdict(False, _WINDOW_SECONDS, "tokens", True)
            excess = self._total - self._base + cost - self._tpm
            if excess > 0:
                # First entry whose expiry frees at least `excess` tokens.
                index = bisect.bisect_left(self._cum, self._base + excess, lo=head)
                token_wait = self._times[index] + _WINDOW_SECONDS - now
                if token_wait > wait:
                    wait, limited_by = token_wait, "tokens"
        if wait > 0:
            return _Verdict(False, wait, limited_by, False)
        self._total += cost
        self._times.append(now)
        self._cum.append(self._total)
        return _Verdict(True, 0.0, "", False)


def _text_of(content: Any) -> str:
    """Text of a message content: a string, or a list of OpenAI/Anthropic text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(
            part["text"]
            for part in content
            if isinstance(part, dict) and isinstance(part.get("text"), str)
        )
    return ""


def _non_negative_int(step: dict[str, Any], key: str, default: int) -> int:
    value = step.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise _BadRequestError(f"step input field {key!r} must be a non-negative integer")
    return value


def _parse_call(body: Any, request: web.Request, *, anthropic: bool) -> _Call:
    if not isinstance(body, dict):
        raise _BadRequestError("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise _BadRequestError("'messages' must be a non-empty array", "invalid_messages")
    system_text = _text_of(body.get("system")) if anthropic else ""
    total_chars = len(system_text)
    last_user: str | None = None
    for message in messages:
        if not isinstance(message, dict):
            raise _BadRequestError("every message must be an object", "invalid_messages")
        text = _text_of(message.get("content"))
        total_chars += len(text)
        if message.get("role") == "user":
            last_user = text
        elif message.get("role") == "system":
            system_text += text
    if last_user is None:
        raise _BadRequestError("no user message to answer", "invalid_messages")

    # OpenAI's current name is max_completion_tokens; older clients and Anthropic send
    # max_tokens. Either bounds the answer and counts against tokens_per_minute.
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise _BadRequestError("'max_tokens' must be a positive integer", "invalid_max_tokens")

    if anthropic:
        metadata = body.get("metadata")
        job_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    else:
        job_id = body.get("user")
    if not isinstance(job_id, str) or not job_id:
        job_id = request.headers.get(_JOB_HEADER, "")

    # Prose (or JSON that is not an object) is a plain successful summarisation request,
    # so the provider stays usable with hand-written prompts.
    step: Any = None
    if last_user.lstrip().startswith("{"):
        try:
            step = json.loads(last_user)
        except ValueError:
            step = None
    if isinstance(step, dict):
        mode = step.get("mode", "success")
        if not isinstance(mode, str):
            raise _BadRequestError("step input field 'mode' must be a string", "invalid_mode")
        raw_text = step.get("text", "")
        text = raw_text if isinstance(raw_text, str) else json.dumps(raw_text)
        fail_times = _non_negative_int(step, "fail_times", _DEFAULT_FAIL_TIMES)
        delay_ms = _non_negative_int(step, "delay_ms", 0)
    else:
        mode, text, fail_times, delay_ms = "success", last_user, _DEFAULT_FAIL_TIMES, 0

    model = body.get("model")
    return _Call(
        anthropic=anthropic,
        model=model if isinstance(model, str) else "",
        job_id=job_id,
        mode=mode,
        text=text,
        fail_times=fail_times,
        delay_seconds=delay_ms / 1000,
        prompt_tokens=max(1, total_chars // 4),
        max_tokens=max_tokens,
        invoice="invoice fields" in system_text.lower(),
    )


_INVOICE_PATTERNS: Final = {
    "vendor": re.compile(r"(?im)^\s*(?:vendor|from|seller)\s*[:#]\s*(.+?)\s*$"),
    "invoice_number": re.compile(r"(?im)\binvoice\s*(?:no\.?|number|#)?\s*[:#]\s*(\S+)"),
    "total": re.compile(
        r"(?im)^\s*(?:total|amount due)\s*[:#]?\s*([A-Z]{3})?\s*([0-9][0-9,]*(?:\.[0-9]+)?)"),
}


def _invoice_json(text: str, confidence: float) -> str:
    """Invoice fields read from ``Vendor: ...``, ``Invoice: ...``, ``Total: EUR 12.50`` lines,
    with placeholders for what the text does not say (deterministic, like the summaries)."""
    vendor = _INVOICE_PATTERNS["vendor"].search(text)
    number = _INVOICE_PATTERNS["invoice_number"].search(text)
    total = _INVOICE_PATTERNS["total"].search(text)
    currency = total.group(1) if total and total.group(1) else "EUR"
    amount = float(total.group(2).replace(",", "")) if total else 0.0
    return json.dumps({
        "vendor": vendor.group(1) if vendor else "unknown",
        "invoice_number": number.group(1) if number else "unknown",
        "total": amount, "currency": currency, "confidence": confidence,
    })


def _result_json(call: _Call, confidence: float) -> str:
    return (_invoice_json(call.text, confidence) if call.invoice
            else _summary_json(call.text, confidence))


def _summary_json(text: str, confidence: float) -> str:
    # maxsplit bounds the work for huge inputs: only the first words are ever needed.
    words = text.split(maxsplit=_SUMMARY_WORDS)[:_SUMMARY_WORDS]
    return json.dumps({"summary": " ".join(words), "confidence": confidence})


_EMBEDDING_DIMENSIONS: Final = 8


def _vector(text: str) -> list[float]:
    import hashlib

    digest = hashlib.sha256(text.encode()).digest()
    raw = [b - 127.5 for b in digest[:_EMBEDDING_DIMENSIONS]]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


def _format_seconds(seconds: float) -> str:
    return str(int(seconds)) if seconds == int(seconds) else f"{seconds:g}"


_ANTHROPIC_ERROR_TYPES: Final = {
    400: "invalid_request_error",
    401: "authentication_error",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


class _Provider:
    """All mutable state of one app; handlers are its bound methods."""

    def __init__(self, settings: FakeProviderSettings, clock: Callable[[], float]) -> None:
        self._settings = settings
        dist = parse_latency(settings.latency_dist or f"fixed:{settings.latency_ms}")
        self._latency_dist, self._latency_rng = dist, dist.sampler()
        self.mode_override = settings.mode_override
        self._limiter = (
            _SlidingWindow(settings.requests_per_minute, settings.tokens_per_minute, clock)
            if settings.requests_per_minute or settings.tokens_per_minute
            else None
        )
        self._ids = itertools.count(1)
        self.calls = 0
        self._status_counts: dict[int, int] = {}
        self._by_job: dict[str, list[int]] = {}  # job id -> [calls, completed]
        self._flaky_attempts: dict[str, int] = {}
        # POST /admin/outage: until this monotonic time every model call fails with the
        # statuses in turn (a provider-wide incident, whatever each job's mode says).
        self._outage_until = 0.0
        self._outage_statuses: tuple[int, ...] = ()
        self._outage_calls = itertools.count()

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

    def _error(
        self,
        call_is_anthropic: bool,
        status: int,
        *,
        kind: str,
        code: str,
        message: str,
        headers: dict[str, str] | None = None,
    ) -> web.Response:
        if call_is_anthropic:
            payload: dict[str, Any] = {
                "type": "error",
                "error": {"type": _ANTHROPIC_ERROR_TYPES[status], "message": message},
            }
        else:
            payload = {"error": {"message": message, "type": kind, "code": code, "param": None}}
        return self._respond(status, payload, headers)

    def _answer(
        self,
        call: _Call,
        content: str,
        *,
        refusal: bool,
        headers: dict[str, str] | None,
    ) -> web.Response:
        completion_tokens = max(1, len(content) // 4)
        number = next(self._ids)
        if call.anthropic:
            payload: dict[str, Any] = {
                "id": f"msg_fake_{number}",
                "type": "message",
                "role": "assistant",
                "model": call.model,
                "content": [{"type": "text", "text": content}],
                "stop_reason": "refusal" if refusal else "end_turn",
                "stop_sequence": None,
                "usage": {
                    "input_tokens": call.prompt_tokens,
                    "output_tokens": completion_tokens,
                },
            }
        else:
            message: dict[str, Any] = (
                {"role": "assistant", "content": None, "refusal": content}
                if refusal
                else {"role": "assistant", "content": content, "refusal": None}
            )
            payload = {
                "id": f"chatcmpl-fake-{number}",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": call.model,
                "choices": [
                    {"index": 0, "message": message, "logprobs": None, "finish_reason": "stop"}
                ],
                "usage": {
                    "prompt_tokens": call.prompt_tokens,
                    "completion_tokens": completion_tokens,
                    "total_tokens": call.prompt_tokens + completion_tokens,
                },
            }
        return self._respond(200, payload, headers)

    def _limit_headers(self) -> dict[str, str]:
        assert self._limiter is not None
        requests_left, tokens_left = self._limiter.remaining()
        headers: dict[str, str] = {}
        if self._settings.requests_per_minute:
            headers["x-ratelimit-limit-requests"] = str(self._settings.requests_per_minute)
            headers["x-ratelimit-remaining-requests"] = str(requests_left)
        if self._settings.tokens_per_minute:
            headers["x-ratelimit-limit-tokens"] = str(self._settings.tokens_per_minute)
            headers["x-ratelimit-remaining-tokens"] = str(tokens_left)
        return headers

    # --- model endpoints -------------------------------------------------------------

    async def handle_openai(self, request: web.Request) -> web.Response:
        return await self._handle(request, anthropic=False)

    async def handle_anthropic(self, request: web.Request) -> web.Response:
        return await self._handle(request, anthropic=True)

    async def _handle(self, request: web.Request, *, anthropic: bool) -> web.Response:
        self.calls += 1
        try:
            call = _parse_call(json.loads(await request.read()), request, anthropic=anthropic)
        except (ValueError, _BadRequestError) as exc:
            # ValueError covers undecodable bytes and invalid JSON.
            bad = exc if isinstance(exc, _BadRequestError) else _BadRequestError("invalid JSON")
            await self._sleep(self._latency)
            return self._error(
                anthropic, 400, kind="invalid_request_error", code=bad.code, message=bad.message
            )

        job_stats: list[int] | None = None
        if call.job_id:
            job_stats = self._by_job.get(call.job_id)
            if job_stats is None:
                job_stats = self._by_job[call.job_id] = [0, 0]
            job_stats[0] += 1

        if self._outage_statuses and time.monotonic() < self._outage_until:
            return await self._outage_answer(call)
        mode = self.mode_override or call.mode
        if mode not in MODES:
            await self._sleep(self._latency)
            return self._error(
                anthropic,
                400,
                kind="invalid_request_error",
                code="unknown_mode",
                message=f"unknown mode {mode!r}; expected one of {', '.join(sorted(MODES))}",
            )

        settings = self._settings
        content: str | None = None
        if mode in ("success", "slow", "flaky"):
            content = _result_json(call, _SUCCESS_CONFIDENCE)
        elif mode == "low_confidence":
            content = _result_json(call, settings.low_confidence)
        elif mode == "malformed":
            content = _MALFORMED_TEXT
        elif mode == "refusal":
            content = _REFUSAL_TEXT

        headers: dict[str, str] | None = None
        # A batch's requests do not count against the online limits (as at OpenAI).
        if self._limiter is not None and _BATCH_HEADER not in request.headers:
            completion = call.max_tokens or (max(1, len(content) // 4) if content else 1)
            verdict = self._limiter.admit(call.prompt_tokens + completion)
            headers = self._limit_headers()
            if not verdict.admitted:
                retry_after = max(1, math.ceil(verdict.retry_after))
                headers["Retry-After"] = str(retry_after)
                headers["retry-after-ms"] = str(max(1, math.ceil(verdict.retry_after * 1000)))
                if verdict.too_large:
                    message = (
                        f"Request too large: limit {settings.tokens_per_minute} tokens per"
                        f" minute, requested {call.prompt_tokens + completion}"
                    )
                else:
                    message = f"Rate limit reached for {verdict.limited_by} per minute"
                await self._sleep(self._latency)
                return self._error(
                    anthropic,
                    429,
                    kind=verdict.limited_by,
                    code="rate_limit_exceeded",
                    message=message,
                    headers=headers,
                )

        failing = False
        if mode == "flaky":
            # Counted on arrival, so concurrent attempts of one job fail in arrival order.
            attempts = self._flaky_attempts.get(call.job_id, 0)
            self._flaky_attempts[call.job_id] = attempts + 1
            failing = attempts < call.fail_times

        delay = self._latency + call.delay_seconds
        if mode == "slow":
            delay += settings.slow_seconds
        await self._sleep(delay)

        if mode == "always_fail" or failing:
            return self._error(
                anthropic,
                503,
                kind="server_error",
                code="upstream_unavailable",
                message="upstream_unavailable",
                headers=headers,
            )
        if mode == "rate_limited":
            limited = dict(headers) if headers else {}
            limited["Retry-After"] = _format_seconds(settings.retry_after_seconds)
            limited["retry-after-ms"] = str(round(settings.retry_after_seconds * 1000))
            return self._error(
                anthropic,
                429,
                kind="requests",
                code="rate_limit_exceeded",
                message="Rate limit reached (simulated for this job)",
                headers=limited,
            )
        if mode == "bad_request":
            return self._error(
                anthropic,
                400,
                kind="invalid_request_error",
                code="bad_request",
                message="The request was rejected as invalid (simulated)",
                headers=headers,
            )
        if mode == "unauthorized":
            return self._error(
                anthropic,
                401,
                kind="invalid_request_error",
                code="invalid_api_key",
                message="Incorrect API key provided (simulated)",
                headers=headers,
            )
        assert content is not None
        if job_stats is not None and mode in _VALID_RESULT_MODES:
            job_stats[1] += 1
        return self._answer(call, content, refusal=mode == "refusal", headers=headers)

    async def handle_embeddings(self, request: web.Request) -> web.Response:
        """OpenAI-shaped embeddings: a deterministic unit vector per input, from its hash."""
        self.calls += 1
        try:
            body = json.loads(await request.read())
            raw = body["input"]
            inputs = [raw] if isinstance(raw, str) else list(raw)
        except (ValueError, KeyError, TypeError):
            inputs = []
        if not inputs or not all(isinstance(i, str) for i in inputs):
            return self._error(False, 400, kind="invalid_request_error", code="invalid_input",
                               message="'input' must be a string or a non-empty array of strings")
        job_id = body.get("user") if isinstance(body.get("user"), str) else ""
        if job_id:
            stats = self._by_job.setdefault(job_id, [0, 0])
            stats[0] += 1
            stats[1] += 1
        await self._sleep(self._latency)
        tokens = sum(max(1, len(i) // 4) for i in inputs)
        return self._respond(200, {
            "object": "list",
            "model": body.get("model", ""),
            "data": [{"object": "embedding", "index": n, "embedding": _vector(text)}
                     for n, text in enumerate(inputs)],
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
        })

    async def _outage_answer(self, call: _Call) -> web.Response:
        await self._sleep(self._latency)
        status = self._outage_statuses[next(self._outage_calls) % len(self._outage_statuses)]
        if status == 429:
            seconds = self._settings.retry_after_seconds
            return self._error(call.anthropic, 429, kind="requests", code="rate_limit_exceeded",
                               message="Rate limit reached (simulated outage)",
                               headers={"Retry-After": _format_seconds(seconds),
                                        "retry-after-ms": str(round(seconds * 1000))})
        return self._error(call.anthropic, status, kind="server_error", code="outage",
                           message="The server had an error (simulated outage)")

    @staticmethod
    async def _sleep(seconds: float) -> None:
        # Skipping the zero sleep keeps the common benchmark path free of a loop round-trip.
        if seconds > 0:
            await asyncio.sleep(seconds)

    # --- observability and admin -----------------------------------------------------

    async def handle_stats(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "calls": self.calls,
                "status_counts": {str(k): v for k, v in self._status_counts.items()},
                "by_job": {
                    job: {"calls": stats[0], "completed": stats[1]}
                    for job, stats in self._by_job.items()
                },
                "mode_override": self.mode_override,
            }
        )

    async def handle_reset(self, request: web.Request) -> web.Response:
        self.calls = 0
        self._status_counts.clear()
        self._by_job.clear()
        self._flaky_attempts.clear()
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
        """``{"seconds": 20, "statuses": [500, 429]}``: every call fails for that long."""
        try:
            body = json.loads(await request.read())
        except ValueError:
            body = None
        seconds = body.get("seconds") if isinstance(body, dict) else None
        statuses = body.get("statuses", [500, 429]) if isinstance(body, dict) else None
        if (isinstance(seconds, bool) or not isinstance(seconds, int | float) or seconds < 0
                or not isinstance(statuses, list) or not statuses
                or not all(s in (429, 500, 503) for s in statuses)):
            return web.json_response(
                {"error": 'body must be {"seconds": >= 0, "statuses": [429 | 500 | 503, ...]}'},
                status=400)
        self._outage_statuses = tuple(statuses)
        self._outage_until = time.monotonic() + float(seconds)
        return web.json_response({"seconds": seconds, "statuses": statuses})

    async def handle_healthz(self, request: web.Request) -> web.Response:
        return web.json_response({"ok": True})


# --- batch APIs ------------------------------------------------------------------------
# OpenAI's Batch API (files + batches) and Anthropic's Message Batches, run by sending each
# request to this server's own online endpoint (so every per-job mode behaves exactly as
# online), after a settable completion delay (`batch_completion_seconds`, or POST
# /admin/batches). `expire_next` makes the next N batches end `expired` at that time, their
# requests unrun, as a provider does when its 24 h window passes.

_BATCH_HEADER: Final = "X-Calmq-Fake-Batch"
_BATCH_CONCURRENCY: Final = 32


def _iso(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


@dataclass(slots=True)
class _Batch:
    id: str
    anthropic: bool
    endpoint: str
    requests: list[dict[str, Any]]
    metadata: dict[str, Any]
    created: float
    expire: bool
    status: str = "validating"  # OpenAI's names; Anthropic's processing_status is derived
    output: list[bytes] | None = None
    errors: list[bytes] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    counts: dict[str, int] | None = None
    ended: float | None = None
    cancel_requested: float | None = None
    task: asyncio.Task[None] | None = None
    cancelled: asyncio.Event = field(default_factory=asyncio.Event)


class _BatchApis:
    """The batch endpoints of one fake provider; state in memory, lost on restart."""

    def __init__(self, settings: FakeProviderSettings) -> None:
        self.completion_seconds = settings.batch_completion_seconds
        self.expire_next = 0
        # Seconds a create waits before it answers, the batch already made: a client killed
        # meanwhile has a batch it never heard of (crash-safety tests).
        self.create_delay = 0.0
        self._files: dict[str, tuple[str, bytes]] = {}  # id -> (purpose, bytes)
        self._batches: dict[str, _Batch] = {}
        self._ids = itertools.count(1)
        self._session: Any = None

    # -- OpenAI -------------------------------------------------------------------------

    async def upload_file(self, request: web.Request) -> web.Response:
        purpose, data, name = "", b"", "input.jsonl"
        reader = await request.multipart()
        while (part := await reader.next()) is not None:
            if not isinstance(part, BodyPartReader):
                continue
            if part.name == "purpose":
                purpose = (await part.read()).decode()
            elif part.name == "file":
                name = part.filename or name
                data = bytes(await part.read())
        if purpose != "batch" or not data:
            return _openai_error(400, "invalid_request_error",
                                 "send a multipart form with purpose=batch and a file")
        file_id = f"file-fake{next(self._ids)}"
        self._files[file_id] = (purpose, data)
        return web.json_response({"id": file_id, "object": "file", "bytes": len(data),
                                  "created_at": int(time.time()), "filename": name,
                                  "purpose": purpose})

    async def create_openai(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
            file_id = body["input_file_id"]
            endpoint = body["endpoint"]
        except (ValueError, KeyError, TypeError):
            return _openai_error(400, "invalid_request_error",
                                 "input_file_id and endpoint are required")
        if body.get("completion_window") != "24h":
            return _openai_error(400, "invalid_request_error", "completion_window must be 24h")
        stored = self._files.get(file_id)
        if stored is None:
            return _openai_error(404, "invalid_request_error", f"no file {file_id}")
        requests: list[dict[str, Any]] = []
        seen: set[str] = set()
        for line in stored[1].splitlines():
            if not line.strip():
                continue
            try:
                item = json.loads(line)
                custom_id = str(item["custom_id"])
                if item["url"] != endpoint or custom_id in seen:
                    raise ValueError(custom_id)
            except (ValueError, KeyError, TypeError):
                return _openai_error(400, "invalid_request_error",
                                     "every line needs a unique custom_id and the batch's url")
            seen.add(custom_id)
            requests.append({"custom_id": custom_id, "body": item.get("body") or {}})
        metadata = body.get("metadata") or {}
        batch = self._start(request, anthropic=False, endpoint=endpoint, requests=requests,
                            metadata=dict(metadata), prefix="batch_fake")
        await self._delay()
        return web.json_response(self._openai_view(batch, file_id))

    async def get_openai(self, request: web.Request) -> web.Response:
        batch = self._batches.get(request.match_info["batch_id"])
        if batch is None or batch.anthropic:
            return _openai_error(404, "invalid_request_error", "no such batch")
        return web.json_response(self._openai_view(batch))

    async def list_openai(self, request: web.Request) -> web.Response:
        batches = [b for b in self._batches.values() if not b.anthropic]
        batches.sort(key=lambda b: b.created, reverse=True)
        after = request.query.get("after")
        if after:
            ids = [b.id for b in batches]
            batches = batches[ids.index(after) + 1:] if after in ids else []
        limit = int(request.query.get("limit", "20"))
        page = batches[:limit]
        return web.json_response({"object": "list", "data": [self._openai_view(b) for b in page],
                                  "first_id": page[0].id if page else None,
                                  "last_id": page[-1].id if page else None,
                                  "has_more": len(batches) > limit})

    async def cancel_openai(self, request: web.Request) -> web.Response:
        batch = self._batches.get(request.match_info["batch_id"])
        if batch is None or batch.anthropic:
            return _openai_error(404, "invalid_request_error", "no such batch")
        self._cancel(batch)
        return web.json_response(self._openai_view(batch))

    async def file_content(self, request: web.Request) -> web.StreamResponse:
        stored = self._files.get(request.match_info["file_id"])
        if stored is None:
            return _openai_error(404, "invalid_request_error", "no such file")
        return await _stream(request, [stored[1]])

    def _openai_view(self, batch: _Batch, file_id: str | None = None) -> dict[str, Any]:
        counts = batch.counts or {}
        return {
            "id": batch.id, "object": "batch", "endpoint": batch.endpoint,
            "input_file_id": file_id, "completion_window": "24h", "status": batch.status,
            "output_file_id": batch.output_file_id, "error_file_id": batch.error_file_id,
            "created_at": int(batch.created),
            "completed_at": int(batch.ended) if batch.ended and batch.status == "completed"
            else None,
            "expired_at": int(batch.ended) if batch.ended and batch.status == "expired"
            else None,
            "cancelled_at": int(batch.ended) if batch.ended and batch.status == "cancelled"
            else None,
            "expires_at": int(batch.created + 24 * 3600),
            "request_counts": {"total": len(batch.requests),
                               "completed": counts.get("succeeded", 0),
                               "failed": counts.get("errored", 0)
                               + counts.get("expired", 0) + counts.get("canceled", 0)},
            "metadata": batch.metadata,
        }

    # -- Anthropic ----------------------------------------------------------------------

    async def create_anthropic(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
            items = body["requests"]
            requests = [{"custom_id": str(i["custom_id"]), "body": dict(i["params"])}
                        for i in items]
        except (ValueError, KeyError, TypeError):
            return _anthropic_error(400, "requests: a list of {custom_id, params}")
        if not requests or len({r["custom_id"] for r in requests}) != len(requests):
            return _anthropic_error(400, "requests must be non-empty with unique custom_id")
        batch = self._start(request, anthropic=True, endpoint="/v1/messages",
                            requests=requests, metadata={}, prefix="msgbatch_fake")
        await self._delay()
        return web.json_response(self._anthropic_view(request, batch))

    async def get_anthropic(self, request: web.Request) -> web.Response:
        batch = self._batches.get(request.match_info["batch_id"])
        if batch is None or not batch.anthropic:
            return _anthropic_error(404, "no such batch", "not_found_error")
        return web.json_response(self._anthropic_view(request, batch))

    async def list_anthropic(self, request: web.Request) -> web.Response:
        batches = [b for b in self._batches.values() if b.anthropic]
        batches.sort(key=lambda b: b.created, reverse=True)
        limit = int(request.query.get("limit", "20"))
        page = batches[:limit]
        return web.json_response({"data": [self._anthropic_view(request, b) for b in page],
                                  "has_more": len(batches) > limit,
                                  "first_id": page[0].id if page else None,
                                  "last_id": page[-1].id if page else None})

    async def cancel_anthropic(self, request: web.Request) -> web.Response:
        batch = self._batches.get(request.match_info["batch_id"])
        if batch is None or not batch.anthropic:
            return _anthropic_error(404, "no such batch", "not_found_error")
        self._cancel(batch)
        return web.json_response(self._anthropic_view(request, batch))

    async def results_anthropic(self, request: web.Request) -> web.StreamResponse:
        batch = self._batches.get(request.match_info["batch_id"])
        if batch is None or not batch.anthropic or batch.output is None:
            return _anthropic_error(404, "no results (yet) for this batch", "not_found_error")
        return await _stream(request, batch.output)

    def _anthropic_view(self, request: web.Request, batch: _Batch) -> dict[str, Any]:
        counts = batch.counts or {}
        ended = batch.ended is not None
        processing = "ended" if ended else (
            "canceling" if batch.cancel_requested else "in_progress")
        return {
            "id": batch.id, "type": "message_batch", "processing_status": processing,
            "request_counts": {"processing": 0 if ended else len(batch.requests),
                               "succeeded": counts.get("succeeded", 0),
                               "errored": counts.get("errored", 0),
                               "canceled": counts.get("canceled", 0),
                               "expired": counts.get("expired", 0)},
            "created_at": _iso(batch.created), "expires_at": _iso(batch.created + 24 * 3600),
            "ended_at": _iso(batch.ended) if batch.ended else None,
            "cancel_initiated_at": _iso(batch.cancel_requested)
            if batch.cancel_requested else None,
            "archived_at": None,
            "results_url": f"{request.url.origin()}/v1/messages/batches/{batch.id}/results"
            if ended else None,
        }

    async def _delay(self) -> None:
        if self.create_delay > 0:
            await asyncio.sleep(self.create_delay)

    # -- the run of a batch -------------------------------------------------------------

    def _start(self, request: web.Request, *, anthropic: bool, endpoint: str,
               requests: list[dict[str, Any]], metadata: dict[str, Any],
               prefix: str) -> _Batch:
        expire = self.expire_next > 0
        if expire:
            self.expire_next -= 1
        batch = _Batch(id=f"{prefix}{next(self._ids)}", anthropic=anthropic,
                       endpoint=endpoint, requests=requests, metadata=metadata,
                       created=time.time(), expire=expire)
        self._batches[batch.id] = batch
        batch.task = asyncio.create_task(self._run(batch, str(request.url.origin())))
        return batch

    def _cancel(self, batch: _Batch) -> None:
        if batch.ended is not None or batch.cancel_requested:
            return
        batch.cancel_requested = time.time()
        batch.status = "cancelling"
        batch.cancelled.set()

    async def _run(self, batch: _Batch, origin: str) -> None:
        import aiohttp

        batch.status = "in_progress"
        with contextlib.suppress(TimeoutError):  # a cancel ends the wait early
            await asyncio.wait_for(batch.cancelled.wait(), self.completion_seconds)
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=_BATCH_CONCURRENCY))
        counts = {"succeeded": 0, "errored": 0, "canceled": 0, "expired": 0}
        output: list[bytes] = []
        errors: list[bytes] = []
        gate = asyncio.Semaphore(_BATCH_CONCURRENCY)

        async def one(number: int, item: dict[str, Any]) -> None:
            custom_id = item["custom_id"]
            if batch.expire or batch.cancel_requested:
                kind = "expired" if batch.expire else "canceled"
                counts[kind] += 1
                if batch.anthropic:
                    output.append(_line({"custom_id": custom_id, "result": {"type": kind}}))
                else:
                    code = "batch_expired" if batch.expire else "batch_cancelled"
                    errors.append(_line({
                        "id": f"batch_req_{batch.id}_{number}", "custom_id": custom_id,
                        "response": None,
                        "error": {"code": code, "message": f"this request was not run: {code}"}}))
                return
            async with gate, self._session.post(
                    origin + batch.endpoint, json=item["body"],
                    headers={_BATCH_HEADER: batch.id}) as resp:
                status, body = resp.status, await resp.json(content_type=None)
            ok = status < 300
            counts["succeeded" if ok else "errored"] += 1
            if batch.anthropic:
                result: dict[str, Any] = ({"type": "succeeded", "message": body} if ok
                                          else {"type": "errored", "error": body})
                output.append(_line({"custom_id": custom_id, "result": result}))
            else:
                (output if ok else errors).append(_line({
                    "id": f"batch_req_{batch.id}_{number}", "custom_id": custom_id,
                    "response": {"status_code": status,
                                 "request_id": f"req_{batch.id}_{number}", "body": body},
                    "error": None}))

        await asyncio.gather(*(one(n, r) for n, r in enumerate(batch.requests)))
        batch.status = "finalizing"
        batch.counts = counts
        batch.output, batch.errors = output, errors
        if not batch.anthropic:
            if output:
                batch.output_file_id = f"file-fake{next(self._ids)}"
                self._files[batch.output_file_id] = ("batch_output", b"".join(output))
            if errors:
                batch.error_file_id = f"file-fake{next(self._ids)}"
                self._files[batch.error_file_id] = ("batch_output", b"".join(errors))
        batch.ended = time.time()
        batch.status = ("expired" if batch.expire else
                        "cancelled" if batch.cancel_requested else "completed")

    # -- admin --------------------------------------------------------------------------

    async def admin(self, request: web.Request) -> web.Response:
        """POST /admin/batches {"completion_seconds": s, "expire_next": n}; GET: counts."""
        if request.method == "POST":
            try:
                body = json.loads(await request.read())
                if "completion_seconds" in body:
                    self.completion_seconds = max(0.0, float(body["completion_seconds"]))
                if "expire_next" in body:
                    self.expire_next = max(0, int(body["expire_next"]))
                if "create_delay_seconds" in body:
                    self.create_delay = max(0.0, float(body["create_delay_seconds"]))
            except (ValueError, TypeError, AttributeError):
                return web.json_response(
                    {"error": 'body: {"completion_seconds": s, "expire_next": n}'}, status=400)
        return web.json_response({
            "completion_seconds": self.completion_seconds, "expire_next": self.expire_next,
            "create_delay_seconds": self.create_delay,
            "batches": len(self._batches),
            "by_status": {s: sum(1 for b in self._batches.values() if b.status == s)
                          for s in {b.status for b in self._batches.values()}},
            "requests": sum(len(b.requests) for b in self._batches.values()),
            "custom_ids": sorted(r["custom_id"] for b in self._batches.values()
                                 for r in b.requests),
        })

    async def synthetic(self, request: web.Request) -> web.Response:
        """POST /admin/batches/synthetic {"lines": n, "pad": bytes}: a completed OpenAI batch
        whose output file holds ``n`` successful answers padded to about ``pad`` bytes each
        (benchmarks: the poller's memory while it streams a large results file)."""
        try:
            body = json.loads(await request.read())
            lines, pad = int(body["lines"]), int(body.get("pad", 1000))
        except (ValueError, KeyError, TypeError):
            return web.json_response({"error": 'body: {"lines": n, "pad": bytes}'}, status=400)
        filler = "x" * max(0, pad - 400)
        chunks = [_line({
            "id": f"batch_req_syn_{n}", "custom_id": f"synthetic-{n}_1",
            "response": {"status_code": 200, "request_id": f"req_syn_{n}", "body": {
                "id": f"chatcmpl-syn-{n}", "object": "chat.completion", "model": "fake-small",
                "choices": [{"index": 0, "finish_reason": "stop", "message": {
                    "role": "assistant", "refusal": None,
                    "content": _summary_json(f"synthetic {n} {filler}", 0.97)}}],
                "usage": {"prompt_tokens": 20, "completion_tokens": 20, "total_tokens": 40}}},
            "error": None}) for n in range(lines)]
        batch = _Batch(id=f"batch_fake{next(self._ids)}", anthropic=False,
                       endpoint="/v1/chat/completions", requests=[], metadata={},
                       created=time.time(), expire=False, status="completed",
                       counts={"succeeded": lines}, ended=time.time())
        batch.output_file_id = f"file-fake{next(self._ids)}"
        self._files[batch.output_file_id] = ("batch_output", b"".join(chunks))
        self._batches[batch.id] = batch
        return web.json_response({**self._openai_view(batch),
                                  "bytes": len(self._files[batch.output_file_id][1])})

    def routes(self, app: web.Application) -> None:
        app.router.add_post("/admin/batches/synthetic", self.synthetic)
        app.router.add_post("/v1/files", self.upload_file)
        app.router.add_get("/v1/files/{file_id}/content", self.file_content)
        app.router.add_post("/v1/batches", self.create_openai)
        app.router.add_get("/v1/batches", self.list_openai)
        app.router.add_get("/v1/batches/{batch_id}", self.get_openai)
        app.router.add_post("/v1/batches/{batch_id}/cancel", self.cancel_openai)
        app.router.add_post("/v1/messages/batches", self.create_anthropic)
        app.router.add_get("/v1/messages/batches", self.list_anthropic)
        app.router.add_get("/v1/messages/batches/{batch_id}", self.get_anthropic)
        app.router.add_post("/v1/messages/batches/{batch_id}/cancel", self.cancel_anthropic)
        app.router.add_get("/v1/messages/batches/{batch_id}/results", self.results_anthropic)
        app.router.add_route("*", "/admin/batches", self.admin)

        async def close(_app: web.Application) -> None:
            for batch in self._batches.values():
                if batch.task is not None:
                    batch.task.cancel()
            if self._session is not None:
                await self._session.close()

        app.on_cleanup.append(close)


def _line(obj: dict[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


async def _stream(request: web.Request, chunks: list[bytes]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "application/jsonl"})
    resp.content_length = sum(len(c) for c in chunks)
    await resp.prepare(request)
    for chunk in chunks:
        await resp.write(chunk)
    await resp.write_eof()
    return resp


def _openai_error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": None,
                                        "param": None}}, status=status)


def _anthropic_error(status: int, message: str,
                     kind: str = "invalid_request_error") -> web.Response:
    return web.json_response({"type": "error", "error": {"type": kind, "message": message}},
                             status=status)


def build_app(
    settings: FakeProviderSettings, *, clock: Callable[[], float] = time.monotonic
) -> web.Application:
    """The fake provider as an aiohttp app; ``clock`` only drives the rate-limit window."""
    provider = _Provider(settings, clock)
    # Prompts in tests can be large; the 1 MiB aiohttp default would turn them into 413s.
    app = web.Application(client_max_size=16 * 1024 * 1024)
    app.router.add_post("/v1/chat/completions", provider.handle_openai)
    app.router.add_post("/v1/messages", provider.handle_anthropic)
    app.router.add_post("/v1/embeddings", provider.handle_embeddings)
    app.router.add_get("/stats", provider.handle_stats)
    app.router.add_post("/admin/reset", provider.handle_reset)
    app.router.add_post("/admin/mode", provider.handle_mode)
    app.router.add_post("/admin/outage", provider.handle_outage)
    app.router.add_get("/healthz", provider.handle_healthz)
    _BatchApis(settings).routes(app)
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
    parser = argparse.ArgumentParser(prog="calmq.tooling.fake_provider", description=__doc__)
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
    args = parser.parse_args(argv)
    settings = FakeProviderSettings(**vars(args))
    # Ctrl-C is the normal way to stop it; a traceback would read like a crash.
    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve(settings))


if __name__ == "__main__":
    main()
