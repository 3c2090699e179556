"""The model gateway: one interface over model providers, and the classification of their
answers into calmq's failure classes.

Providers: Chat Completions (OpenAI, Azure OpenAI, OpenAI-compatible servers such as vLLM,
Ollama and LiteLLM, and calmq's fake provider) and Anthropic Messages. One aiohttp session
per provider, reused. The requests are built by hand and checked in the test suite against
the official SDKs' request types (docs/explanation/decisions.md says why not the SDKs);
structured outputs go in each provider's dialect (calmq.calls.output_schemas); failures become
registered codes (calmq.failure_codes).

A call is answered whole (``complete``) or streamed (``stream``: the provider's
server-sent events, OpenAI's ``stream: true`` with ``stream_options.include_usage``,
Anthropic's ``stream: true``), which gives the text as the model writes it and, at the end,
the same ``ModelReply`` with the usage the stream reported.
"""

from __future__ import annotations

import email.utils
import fnmatch
import json
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import aclosing
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import aiohttp

from calmq.calls import caching
from calmq.calls.output_schemas import anthropic_schema, openai_schema_name, openai_strict_schema
from calmq.errors import StepFailure
from calmq.failure_codes import failure
from calmq.jobs import Priority

__all__ = [
    "ANTHROPIC_VERSION",
    "RETRY_AFTER_MAX_SECONDS",
    "SERVICE_TIER",
    "AnthropicProvider",
    "CallScope",
    "Embedder",
    "EmbeddingReply",
    "Endpoint",
    "ModelClock",
    "ModelReply",
    "ModelStream",
    "OpenAIProvider",
    "Provider",
    "RateLimits",
    "Streamer",
    "classify_status",
    "current_clock",
    "current_scope",
    "enter_scope",
    "model_clock",
    "open_provider",
    "rate_limits",
    "retry_after",
    "structured_outputs",
]


@dataclass(frozen=True)
class CallScope:
    """Whose model calls these are: the budget's priority, the cost metrics' labels.

    The step runner enters one per job attempt; a step's ``provider.complete`` calls made in
    that task see it without every step having to pass it along.
    """

    job_id: str = ""
    tenant_id: str = ""
    workflow: str = ""
    priority: str = Priority.BULK
    # Wall time (epoch seconds) by which the call must have answered: the earlier of the
    # job's deadline and the end of the step's timeout; None: no bound (calmq.calls.tiers).
    deadline: float | None = None


_SCOPE: ContextVar[CallScope | None] = ContextVar("calmq_call_scope", default=None)


def enter_scope(scope: CallScope) -> None:
    """Set the scope for the rest of the current task.

    Each job attempt runs in its own asyncio task, which holds its own copy of the context,
    so a scope never leaks to another job.
    """
    _SCOPE.set(scope)


def current_scope() -> CallScope:
    return _SCOPE.get() or CallScope()


class ModelClock:
    """One attempt's model calls: seconds spent waiting for the answers (calls summed) and
    the calls' tokens and cost, which the step runner writes in the same transaction as the
    attempt's outcome instead of one more transaction per call.
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self.input_tokens = 0
        self.output_tokens = 0
        self.cost_usd = 0.0
        # Of the input: read from and written to the provider's prompt cache, and what the
        # cache saved (calmq.calls.caching).
        self.cached_input_tokens = 0
        self.cache_write_tokens = 0
        self.cache_saved_usd = 0.0
        # The model that served the attempt's last call (a step may fall back to another
        # of its allowed models: calmq.calls.fallback); None before any answered call.
        self.model: str | None = None
        # Per call asked at a service tier: {model, chosen, served[, moved, moved_ms]}
        # (calmq.calls.tiers), for the attempt's event in the job's history.
        self.tiers: list[dict[str, Any]] = []

    def add_usage(self, input_tokens: int, output_tokens: int, cost_usd: float,
                  model: str | None = None, cache: caching.CacheUse | None = None) -> None:
        self.calls += 1
        if cache is not None:
            self.cached_input_tokens += cache.read
            self.cache_write_tokens += cache.written
            self.cache_saved_usd += cache.saved_usd
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        self.cost_usd += cost_usd
        if model is not None:
            self.model = model


# The service tier the call being sent in this task asks for (calmq.calls.tiers sets it
# around one call); None: the request names none (the provider's default tier).
SERVICE_TIER: ContextVar[str | None] = ContextVar("calmq_service_tier", default=None)

_CLOCK: ContextVar[ModelClock | None] = ContextVar("calmq_model_clock", default=None)


def model_clock() -> ModelClock:
    """Start timing and metering the current task's model calls (the runner does, once per
    attempt): model time against the rest of an attempt is what the metrics split, and the
    usage goes into the attempt's outcome."""
    clock = ModelClock()
    _CLOCK.set(clock)
    return clock


def current_clock() -> ModelClock | None:
    return _CLOCK.get()


@dataclass(frozen=True)
class ModelReply:
    content: str | None
    refusal: str | None
    input_tokens: int
    output_tokens: int
    # Of the input tokens, those the provider served from its prompt cache (cheaper); of the
    # output tokens, those spent reasoning; the service tier the provider says it served.
    cached_input_tokens: int = 0
    reasoning_tokens: int = 0
    service_tier: str | None = None
    # Of the input tokens, those written to the prompt cache (Anthropic's cache writes).
    cache_write_tokens: int = 0


class Provider(Protocol):
    async def complete(
        self,
        *,
        messages: list[dict[str, str]],
        job_id: str,
        max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> ModelReply: ...

    async def close(self) -> None: ...


class ModelStream:
    """One streamed model call: ``async for text in stream`` gives the text as the model
    writes it; once the stream has ended, ``reply`` holds the whole answer and its usage, as
    ``complete`` would have returned it. ``await stream.final()`` reads whatever is left and
    returns the reply. Nothing is sent before the first read; a stream is read once.

    A stream that breaks off after it began is ``stream_interrupted`` (transient: the next
    attempt starts a new stream); one refused before it began fails as ``complete`` would.
    """

    def __init__(self, source: Callable[[ModelStream], AsyncIterator[str]]) -> None:
        # ``source(self)`` yields the deltas and sets ``reply`` once the provider ended it.
        self._source = source
        self._iterator: AsyncIterator[str] | None = None
        self.reply: ModelReply | None = None

    def __aiter__(self) -> ModelStream:
        return self

    async def __anext__(self) -> str:
        if self._iterator is None:
            self._iterator = aiter(self._source(self))
        return await anext(self._iterator)

    async def final(self) -> ModelReply:
        """The reply, once every delta is read (those not read yet are read here)."""
        async for _text in self:
            pass
        if self.reply is None:
            raise failure("stream_interrupted", "the model's stream ended without its reply")
        return self.reply

    async def aclose(self) -> None:
        """Stop reading (the connection is closed); a stream left unread needs no close."""
        iterator = self._iterator
        close = getattr(iterator, "aclose", None)
        if close is not None:
            await close()


@runtime_checkable
class Streamer(Protocol):
    """A provider that can stream a call (calmq's gateway providers and their budget)."""

    def stream(
        self,
        *,
        messages: list[dict[str, str]],
        job_id: str,
        max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> ModelStream: ...


@dataclass(frozen=True)
class EmbeddingReply:
    vectors: list[list[float]]
    input_tokens: int


@runtime_checkable
class Embedder(Protocol):
    """A provider that also embeds text (OpenAI-compatible ``POST /v1/embeddings``)."""

    async def embed(self, *, inputs: list[str], job_id: str) -> EmbeddingReply: ...


# The longest wait a provider's retry-after may impose (Settings.provider_retry_after_max_
# seconds passes the configured one): a proxy, a gateway or a misconfigured provider that
# answers ``Retry-After: 86400`` would otherwise pause a model for the whole fleet a day.
RETRY_AFTER_MAX_SECONDS = 300.0


def _wait_seconds(raw: str, scale: float) -> float | None:
    """``raw`` as seconds, None when it is not a finite number (``inf``, ``nan`` and
    ``1e999``, which ``float`` reads as infinity, are no wait at all, not a wait for ever)."""
    try:
        seconds = float(raw) / scale
    except (TypeError, ValueError):
        return None
    return seconds if math.isfinite(seconds) else None


def retry_after(headers: Any, maximum: float = RETRY_AFTER_MAX_SECONDS) -> float | None:
    """How long the provider asks to wait: OpenAI's ``retry-after-ms`` (milliseconds, the
    precise one), else ``retry-after`` in seconds (or an HTTP date); at most ``maximum``.
    A value that is not a finite number is treated as absent."""
    if headers is None:
        return None
    raw_ms = headers.get("retry-after-ms")
    if raw_ms is not None and (seconds := _wait_seconds(raw_ms, 1000)) is not None:
        return min(maximum, max(0.0, seconds))
    raw = headers.get("Retry-After")
    if raw is None:
        return None
    seconds = _wait_seconds(raw, 1)
    if seconds is None:
        try:
            when = email.utils.parsedate_to_datetime(raw)
        except (TypeError, ValueError, IndexError):
            return None
        seconds = when.timestamp() - time.time()
    return min(maximum, max(0.0, seconds))


@dataclass(frozen=True)
class RateLimits:
    """The limits a provider states in an answer's headers (None: not stated).

    OpenAI: ``x-ratelimit-{limit,remaining}-{requests,tokens}``; Anthropic:
    ``anthropic-ratelimit-{requests,tokens,input-tokens,output-tokens}-{limit,remaining}``
    (``tokens`` is the stricter of input and output for the budget)."""

    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    requests_remaining: int | None = None
    tokens_remaining: int | None = None
    names: tuple[str, ...] = ()  # the rate-limit headers that came back

    @property
    def stated(self) -> bool:
        return self.requests_per_minute is not None or self.tokens_per_minute is not None


def _int(headers: Any, name: str) -> int | None:
    raw = headers.get(name)
    try:
        return int(float(raw)) if raw is not None else None
    except ValueError:
        return None


def rate_limits(headers: Any) -> RateLimits:
    """The rate limits an answer's headers state, in either provider's names."""
    if headers is None:
        return RateLimits()
    names = tuple(sorted(k.lower() for k in headers
                         if k.lower().startswith(("x-ratelimit-", "anthropic-ratelimit-"))
                         or k.lower() in ("retry-after", "retry-after-ms")))
    if any(n.startswith("anthropic-ratelimit-") for n in names):
        tokens = [t for t in (_int(headers, "anthropic-ratelimit-tokens-limit"),
                              _int(headers, "anthropic-ratelimit-input-tokens-limit"))
                  if t is not None]
        left = [t for t in (_int(headers, "anthropic-ratelimit-tokens-remaining"),
                            _int(headers, "anthropic-ratelimit-input-tokens-remaining"))
                if t is not None]
        return RateLimits(_int(headers, "anthropic-ratelimit-requests-limit"),
                          min(tokens) if tokens else None,
                          _int(headers, "anthropic-ratelimit-requests-remaining"),
                          min(left) if left else None, names)
    return RateLimits(_int(headers, "x-ratelimit-limit-requests"),
                      _int(headers, "x-ratelimit-limit-tokens"),
                      _int(headers, "x-ratelimit-remaining-requests"),
                      _int(headers, "x-ratelimit-remaining-tokens"), names)


# How OpenAI, Azure OpenAI and LiteLLM name a request refused by their content policy.
_POLICY_MARKS = ("content_policy", "content_filter")
_CONTEXT_MARKS = ("context_length_exceeded", "prompt is too long", "maximum context length")
# Exhausted billing, which blocks a provider and model for the fleet: matched only in the
# provider's structured error code and type (``_error_codes``), never in the error's free
# text, which may echo the prompt: a tenant whose input says "insufficient_quota" must not
# stop every tenant's calls.
_QUOTA_MARKS = ("insufficient_quota", "billing_error", "credit balance is too low")


def _error_codes(body: str) -> list[str]:
    """The provider's structured error code and type, from its JSON body: OpenAI's
    ``error.code`` and ``error.type``, Anthropic's ``error.type``; a batch result line's
    error object carries them at its top (``{"code", "message"}``). Messages are not read.
    A body that is not JSON (a firewall's HTML page) has none."""
    try:
        data = json.loads(body)
    except ValueError:
        return []
    if not isinstance(data, dict):
        return []
    codes = []
    for holder in (data.get("error"), data):
        if isinstance(holder, dict):
            codes += [str(v).lower() for k in ("code", "type")
                      if isinstance(v := holder.get(k), str)]
    return codes


def classify_status(status: int, body: str, headers: Any = None, *,
                    retry_after_max: float = RETRY_AFTER_MAX_SECONDS) -> StepFailure:
    """Turn a provider's non-2xx answer into a StepFailure of a registered code
    (calmq.failure_codes): what each status and error body means is declared there.
    ``retry_after_max``: the longest retry-after taken from ``headers``."""
    detail = body[:300]
    wait = retry_after(headers, retry_after_max)
    codes = _error_codes(body)
    if status == 402 or any(mark in code for code in codes for mark in _QUOTA_MARKS):
        return failure("insufficient_quota", f"the provider account's quota or credit is "
                       f"used up ({status}): {detail}")
    if status == 429 and "resource_unavailable" in codes:
        # OpenAI's flex tier without capacity: not a rate limit (nothing to pause), and
        # calmq.calls.tiers sends the call again at the standard tier.
        return failure("flex_unavailable", f"the flex tier has no capacity now: {detail}")
    if status == 429:
        return failure("rate_limited", f"rate limited by the provider: {detail}",
                       retry_after=wait)
    # Anthropic's overloaded_error (its 529; a batch result names only the type): the same
    # code online and in a batch.
    if status == 529 or (status >= 500 and "overloaded_error" in body):
        return failure("provider_overloaded", f"the provider is overloaded ({status}): "
                       f"{detail}", retry_after=wait)
    if status >= 500:
        return failure("upstream_unavailable", f"provider answered {status}: {detail}",
                       retry_after=wait)
    if status == 401:
        return failure("provider_auth", f"the provider refused the key (401): {detail}")
    if status == 403:
        return failure("provider_permission", f"the key may not do this (403): {detail}")
    if status == 404:
        return failure("model_not_found", f"the provider has no such model or endpoint for "
                       f"this key (404): {detail}")
    if status == 408:
        return failure("timeout", "provider timed out")
    if status == 413:
        return failure("request_too_large", f"the request is too large (413): {detail}")
    if any(mark in body for mark in _CONTEXT_MARKS):
        return failure("context_length_exceeded", f"the prompt is longer than the model's "
                       f"context ({status}): {detail}")
    if status == 400 and any(mark in body for mark in _POLICY_MARKS):
        return failure("content_policy", f"the provider refused the content: {detail}")
    return failure("provider_bad_request",
                   f"provider rejected the request ({status}): {detail}")


Observer = Callable[[int, RateLimits], None]


@dataclass(frozen=True)
class Endpoint:
    """Where one provider's API lives and how it is authenticated.

    ``kind``: ``openai`` (api.openai.com, and OpenAI-compatible servers: vLLM, Ollama,
    LiteLLM), ``azure`` (Azure OpenAI: the ``api-key`` header; the v1 API at
    ``https://RESOURCE.openai.azure.com/openai/v1`` or a deployment URL
    ``.../openai/deployments/NAME`` with ``api_version``), ``anthropic``. ``base_url`` may
    end in ``/v1`` or not. ``extra_headers`` go on every request (a LiteLLM proxy's or a
    gateway's own headers)."""

    kind: str
    base_url: str
    api_key: str = ""
    extra_headers: tuple[tuple[str, str], ...] = ()
    api_version: str = ""

    @property
    def deployment(self) -> bool:
        return self.kind == "azure" and "/openai/deployments/" in self.base_url

    @property
    def api_base(self) -> str:
        """The prefix of the API's paths (``/chat/completions``, ``/files``, ``/batches``)."""
        base = self.base_url.rstrip("/")
        if self.kind == "azure":
            if self.deployment:
                return base.split("/openai/deployments/")[0] + "/openai/v1"
            return base if base.endswith("/openai/v1") else base + "/openai/v1"
        return base if base.endswith("/v1") else base + "/v1"

    def url(self, path: str) -> str:
        """The URL of ``path`` (``/chat/completions``, ``/embeddings``, ``/files``...)."""
        if self.deployment and path in ("/chat/completions", "/embeddings"):
            query = f"?api-version={self.api_version}" if self.api_version else ""
            return self.base_url.rstrip("/") + path + query
        return self.api_base + path

    def headers(self) -> dict[str, str]:
        if self.kind == "anthropic":
            headers = {"x-api-key": self.api_key, "anthropic-version": ANTHROPIC_VERSION}
        elif self.kind == "azure":
            headers = {"api-key": self.api_key} if self.api_key else {}
        else:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {**headers, **dict(self.extra_headers)}


ANTHROPIC_VERSION = "2023-06-01"
STRUCTURED = ("schema", "prompt")


def structured_outputs(kind: str, model: str, overrides: Mapping[str, str] | None) -> bool:
    """Whether to send the output's schema to this provider and model (``schema``) or only
    ask in the prompt (``prompt``). ``overrides`` maps model names (``fnmatch`` patterns) to
    either; by default every model takes the schema but Anthropic's Claude 3 family, which
    does not support structured outputs."""
    for pattern, choice in (overrides or {}).items():
        if fnmatch.fnmatchcase(model, pattern):
            return choice == "schema"
    return not (kind == "anthropic" and model.startswith("claude-3"))


class _HttpProvider:
    kind = "openai"

    def __init__(self, base_url: str, api_key: str, model: str, *,
                 endpoint: Endpoint | None = None,
                 structured: Mapping[str, str] | None = None,
                 retry_after_max: float = RETRY_AFTER_MAX_SECONDS) -> None:
        self.endpoint_config = endpoint or Endpoint(self.kind, base_url, api_key)
        self.retry_after_max = retry_after_max
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.model = model
        self.schema_on = structured_outputs(self.endpoint_config.kind, model, structured)
        self._session: aiohttp.ClientSession | None = None
        self._derived: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        # Told the status and stated limits of every answer (the budget learns from them).
        self.observer: Observer | None = None

    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=0, ttl_dns_cache=300),
                timeout=aiohttp.ClientTimeout(total=None),
            )
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()

    def derived(self, schema: dict[str, Any], derive: Callable[[dict[str, Any]],
                                                               dict[str, Any]]) -> dict[str, Any]:
        """``derive(schema)``, once per schema object (steps pass the same dict each call)."""
        hit = self._derived.get(id(schema))
        if hit is None or hit[0] is not schema:
            hit = self._derived[id(schema)] = (schema, derive(schema))
        return hit[1]

    async def _post(self, path: str, body: dict[str, Any]) -> Any:
        from calmq.tracing import current_traceparent

        headers = self.endpoint_config.headers()
        traceparent = current_traceparent()
        if traceparent:  # the job's trace goes on to the provider (W3C trace context)
            headers["traceparent"] = traceparent
        started = time.monotonic()
        clock = _CLOCK.get()
        try:
            url = self.endpoint_config.url(path)
            async with self.session().post(url, json=body, headers=headers) as resp:
                if self.observer is not None:
                    self.observer(resp.status, rate_limits(resp.headers))
                try:
                    text = await resp.text()
                except aiohttp.ClientPayloadError as exc:
                    # The headers came, the body was cut off: the provider may have counted it.
                    raise failure("upstream_garbled", f"the provider's answer was cut off "
                                  f"({resp.status}): {exc}") from exc
                if resp.status >= 300:
                    raise classify_status(resp.status, text, resp.headers,
                                          retry_after_max=self.retry_after_max)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise failure("connection_error", f"cannot reach the provider: {exc}") from exc
        except TimeoutError as exc:
            raise failure("timeout", "provider timed out") from exc
        finally:
            if clock is not None:
                clock.seconds += time.monotonic() - started
        try:
            return json.loads(text)
        except ValueError as exc:
            raise failure("upstream_garbled",
                          "provider answered 2xx with a body that is not JSON") from exc

    async def _events(self, path: str, body: dict[str, Any]
                      ) -> AsyncGenerator[tuple[str, str], None]:
        """POST a streamed call and yield its server-sent events as (event, data).

        Refused before the stream began: the failure ``complete`` would raise (the status
        classified, or ``connection_error``). Broken off after it began (the connection
        reset, the body cut short): ``stream_interrupted``, which keeps the call's budget
        (the provider counted what it generated)."""
        from calmq.tracing import current_traceparent

        headers = {**self.endpoint_config.headers(), "Accept": "text/event-stream"}
        traceparent = current_traceparent()
        if traceparent:
            headers["traceparent"] = traceparent
        started = time.monotonic()
        clock = _CLOCK.get()
        began = False
        try:
            url = self.endpoint_config.url(path)
            async with self.session().post(url, json=body, headers=headers) as resp:
                if self.observer is not None:
                    self.observer(resp.status, rate_limits(resp.headers))
                if resp.status >= 300:
                    try:
                        text = await resp.text()
                    except aiohttp.ClientPayloadError as exc:
                        raise failure("upstream_garbled", f"the provider's error answer was "
                                      f"cut off ({resp.status}): {exc}") from exc
                    raise classify_status(resp.status, text, resp.headers,
                                          retry_after_max=self.retry_after_max)
                began = True
                event, data = "", list[str]()
                # Lines end at b"\n", so a UTF-8 character never straddles two of them.
                async for raw in resp.content:
                    line = raw.decode("utf-8", "replace").rstrip("\r\n")
                    if not line:
                        if data:
                            yield event, "\n".join(data)
                        event, data = "", []
                        continue
                    if line.startswith(":"):  # a comment (keep-alive)
                        continue
                    name, _, value = line.partition(":")
                    value = value.removeprefix(" ")
                    if name == "event":
                        event = value
                    elif name == "data":
                        data.append(value)
                if data:
                    yield event, "\n".join(data)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            if began:
                raise failure("stream_interrupted", f"the provider's stream broke off: "
                              f"{exc}") from exc
            raise failure("connection_error", f"cannot reach the provider: {exc}") from exc
        except TimeoutError as exc:
            raise failure("timeout", "provider timed out") from exc
        finally:
            if clock is not None:
                clock.seconds += time.monotonic() - started

    def _streamed(self, path: str, body: dict[str, Any], reading: _StreamReading) -> ModelStream:
        """A ``ModelStream`` of the call ``body`` to ``path``, read by ``reading``."""

        async def source(out: ModelStream) -> AsyncIterator[str]:
            async with aclosing(self._events(path, body)) as events:
                async for event, data in events:
                    try:
                        payload = json.loads(data) if data != "[DONE]" else None
                    except ValueError as exc:
                        raise failure("upstream_garbled", f"a stream event that is not JSON: "
                                      f"{data[:120]!r}") from exc
                    text = reading.add(event, payload)
                    if text:
                        yield text
                    if reading.ended:
                        break
            if not reading.ended:
                raise failure("stream_interrupted", "the provider's stream ended before its "
                              "last event")
            try:
                out.reply = reading.reply()
            except (TypeError, ValueError, OverflowError) as exc:
                # A usage count that is not a number (or 1e999: infinity) is a garbled
                # answer, as in a whole reply (parse_reply), not a bug of the step.
                raise failure("upstream_garbled", "the stream's usage is not a count of "
                              "tokens") from exc

        return ModelStream(source)

    def embeddings_body(self, inputs: list[str], job_id: str) -> dict[str, Any]:
        """The body of ``POST /v1/embeddings`` (OpenAI's shape, which Azure, vLLM, Ollama,
        LiteLLM and Voyage's OpenAI-compatible endpoint also serve)."""
        return {"model": self.model, "input": inputs, "user": job_id}

    async def embed(self, *, inputs: list[str], job_id: str) -> EmbeddingReply:
        data = await self._post("/embeddings", self.embeddings_body(inputs, job_id))
        try:
            rows = sorted(data["data"], key=lambda r: int(r["index"]))
            vectors = [[float(x) for x in r["embedding"]] for r in rows]
            usage = data.get("usage") or {}
            return EmbeddingReply(vectors, int(usage.get("prompt_tokens", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise failure("upstream_garbled", "provider answer lacks data[].embedding") from exc


class OpenAIProvider(_HttpProvider):
    """Chat Completions (``POST {base}/v1/chat/completions``): OpenAI, Azure OpenAI and
    OpenAI-compatible servers."""

    # The API's own name of the endpoint (a batch's ``endpoint`` and each line's ``url``).
    endpoint = "/v1/chat/completions"

    async def complete(
        self,
        *,
        messages: list[dict[str, str]],
        job_id: str,
        max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> ModelReply:
        body = self.request_body(messages=messages, job_id=job_id, max_tokens=max_tokens,
                                 response_schema=response_schema)
        return self.parse_reply(await self._post("/chat/completions", body))

    def request_body(
        self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The body of the call; a provider batch sends the very same (calmq.calls.batch_apis)."""
        # max_completion_tokens, not the deprecated max_tokens: reasoning models (o1, o3, ...)
        # answer 400 to max_tokens, which calmq would dead-letter as an input error.
        scope = current_scope()
        messages, cached = caching.openai_prompt(messages, scope.workflow, scope.tenant_id)
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "user": job_id,
            "max_completion_tokens": max_tokens, **cached,
        }
        tier = SERVICE_TIER.get()
        if tier is not None:
            body["service_tier"] = tier
        if response_schema is not None and self.schema_on:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": openai_schema_name(response_schema),
                                "schema": self.derived(response_schema, openai_strict_schema),
                                "strict": True},
            }
        return body

    def stream(
        self,
        *,
        messages: list[dict[str, str]],
        job_id: str,
        max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> ModelStream:
        body = self.stream_body(messages=messages, job_id=job_id, max_tokens=max_tokens,
                                response_schema=response_schema)
        return self._streamed("/chat/completions", body, _OpenAIReading())

    def stream_body(
        self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The body of a streamed call: the same call, ``stream: true``, and
        ``stream_options.include_usage`` (else a stream reports no usage to settle)."""
        return {**self.request_body(messages=messages, job_id=job_id, max_tokens=max_tokens,
                                    response_schema=response_schema),
                "stream": True, "stream_options": {"include_usage": True}}

    @staticmethod
    def parse_reply(data: Any) -> ModelReply:
        """A 2xx answer's reply (also a batch result line's ``response.body``)."""
        try:
            choice = data["choices"][0]
            message = choice["message"]
            usage = data.get("usage") or {}
            refusal = message.get("refusal")
            if not refusal and choice.get("finish_reason") == "content_filter":
                refusal = "the provider's content filter stopped the answer"
            cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            reasoning = (usage.get("completion_tokens_details") or {}).get(
                "reasoning_tokens") or 0
            return ModelReply(
                content=message.get("content"),
                refusal=refusal,
                input_tokens=int(usage.get("prompt_tokens", 0)),
                output_tokens=int(usage.get("completion_tokens", 0)),
                cached_input_tokens=int(cached), reasoning_tokens=int(reasoning),
                service_tier=data.get("service_tier"),
            )
        # OverflowError: a token count of 1e999 (infinity) is garbled too, not a bug.
        except (KeyError, IndexError, TypeError, ValueError, OverflowError) as exc:
            raise failure("upstream_garbled", "provider answer lacks choices[0].message") from exc


class AnthropicProvider(_HttpProvider):
    """Anthropic Messages (``POST {base}/v1/messages``)."""

    kind = "anthropic"
    endpoint = "/v1/messages"

    async def complete(
        self,
        *,
        messages: list[dict[str, str]],
        job_id: str,
        max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> ModelReply:
        body = self.request_body(messages=messages, job_id=job_id, max_tokens=max_tokens,
                                 response_schema=response_schema)
        return self.parse_reply(await self._post("/messages", body))

    def stream(
        self,
        *,
        messages: list[dict[str, str]],
        job_id: str,
        max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> ModelStream:
        body = self.stream_body(messages=messages, job_id=job_id, max_tokens=max_tokens,
                                response_schema=response_schema)
        return self._streamed("/messages", body, _AnthropicReading())

    def stream_body(
        self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The body of a streamed call: the same call with ``stream: true`` (Messages has
        no stream options: the usage comes in ``message_start`` and ``message_delta``)."""
        return {**self.request_body(messages=messages, job_id=job_id, max_tokens=max_tokens,
                                    response_schema=response_schema), "stream": True}

    async def embed(self, *, inputs: list[str], job_id: str) -> EmbeddingReply:
        raise failure("not_supported", "Anthropic has no embeddings API: set "
                      "CALMQ_EMBEDDINGS_PROVIDER (OpenAI, Azure OpenAI, Voyage or an "
                      "OpenAI-compatible server)")

    def request_body(
        self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The body of the call (a batch request's ``params``); the output's schema goes in
        ``output_config.format`` for models that take it, else only the prompt asks."""
        # A marked prefix: cache_control on its last block (calmq.calls.caching).
        system, rest = caching.anthropic_prompt(messages)
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "messages": rest,
            "metadata": {"user_id": job_id},
        }
        if system:
            body["system"] = system
        if response_schema is not None and self.schema_on:
            body["output_config"] = {"format": {
                "type": "json_schema",
                "schema": self.derived(response_schema, anthropic_schema)}}
        return body

    @staticmethod
    def parse_reply(data: Any) -> ModelReply:
        """A 2xx answer's reply (also a batch result's ``message``)."""
        try:
            text = "".join(b.get("text", "") for b in data["content"] if b.get("type") == "text")
            usage = data.get("usage") or {}
            refusal = text if data.get("stop_reason") == "refusal" else None
            cached = int(usage.get("cache_read_input_tokens") or 0)
            return ModelReply(
                content=None if refusal else text,
                refusal=refusal,
                # Anthropic counts cache reads and writes apart from input_tokens: calmq's
                # input is all of them (a write is billed at least at the input price).
                input_tokens=int(usage.get("input_tokens", 0)) + cached
                + int(usage.get("cache_creation_input_tokens") or 0),
                output_tokens=int(usage.get("output_tokens", 0)),
                cached_input_tokens=cached,
                service_tier=usage.get("service_tier"),
                cache_write_tokens=int(usage.get("cache_creation_input_tokens") or 0),
            )
        except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            raise failure("upstream_garbled", "provider answer lacks content") from exc


class _StreamReading(Protocol):
    """How one provider's stream events add up to deltas and a reply."""

    ended: bool

    def add(self, event: str, payload: Any) -> str: ...

    def reply(self) -> ModelReply: ...


def _stream_error(payload: Any) -> StepFailure:
    """An error event in the middle of a stream (Anthropic's ``event: error``, OpenAI's
    ``{"error": ...}`` chunk): the stream broke off after it began."""
    error = payload.get("error") if isinstance(payload, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return failure("stream_interrupted", f"the provider broke off its stream: {kind}: "
                   f"{str(message)[:200]}")


class _OpenAIReading:
    """Chat Completions chunks: ``choices[0].delta.content`` (or ``.refusal``) pieces, the
    ``finish_reason``, and with ``include_usage`` a last chunk whose ``usage`` is the call's;
    ``data: [DONE]`` ends it."""

    def __init__(self) -> None:
        self.ended = False
        self._parts: list[str] = []
        self._refusal: list[str] = []
        self._finish: str | None = None
        self._usage: dict[str, Any] = {}
        self._tier: str | None = None

    def add(self, event: str, payload: Any) -> str:
        if payload is None:  # [DONE]
            self.ended = True
            return ""
        if not isinstance(payload, dict):
            raise failure("upstream_garbled", "a stream chunk that is not an object")
        if payload.get("error") is not None:
            raise _stream_error(payload)
        if payload.get("usage"):
            self._usage = payload["usage"]
        if payload.get("service_tier"):
            self._tier = payload["service_tier"]
        text = ""
        for choice in payload.get("choices") or ():
            if choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            if delta.get("content"):
                text = delta["content"]
                self._parts.append(text)
            if delta.get("refusal"):
                self._refusal.append(delta["refusal"])
            if choice.get("finish_reason"):
                self._finish = choice["finish_reason"]
        return text

    def reply(self) -> ModelReply:
        usage = self._usage
        refusal = "".join(self._refusal) or None
        if not refusal and self._finish == "content_filter":
            refusal = "the provider's content filter stopped the answer"
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        reasoning = (usage.get("completion_tokens_details") or {}).get("reasoning_tokens") or 0
        return ModelReply(content="".join(self._parts) if not self._refusal else None,
                          refusal=refusal, input_tokens=int(usage.get("prompt_tokens", 0)),
                          output_tokens=int(usage.get("completion_tokens", 0)),
                          cached_input_tokens=int(cached), reasoning_tokens=int(reasoning),
                          service_tier=self._tier)


class _AnthropicReading:
    """Messages events: ``message_start`` (the input usage), ``content_block_delta`` with
    ``text_delta`` pieces, ``message_delta`` (stop reason, the output usage so far),
    ``message_stop`` (the end); ``ping`` and the block start and stop carry nothing."""

    def __init__(self) -> None:
        self.ended = False
        self._parts: list[str] = []
        self._stop: str | None = None
        self._usage: dict[str, Any] = {}

    def add(self, event: str, payload: Any) -> str:
        if not isinstance(payload, dict):
            raise failure("upstream_garbled", "a stream event that is not an object")
        kind = payload.get("type") or event
        if kind == "error":
            raise _stream_error(payload)
        if kind == "message_start":
            self._usage.update((payload.get("message") or {}).get("usage") or {})
        elif kind == "content_block_start":
            block = payload.get("content_block") or {}
            if block.get("type") == "text" and block.get("text"):
                self._parts.append(block["text"])
                return str(block["text"])
        elif kind == "content_block_delta":
            delta = payload.get("delta") or {}
            if delta.get("type") == "text_delta" and delta.get("text"):
                self._parts.append(delta["text"])
                return str(delta["text"])
        elif kind == "message_delta":
            self._stop = (payload.get("delta") or {}).get("stop_reason") or self._stop
            # Cumulative counts: the last message_delta's are the call's.
            self._usage.update({k: v for k, v in (payload.get("usage") or {}).items()
                                if v is not None})
        elif kind == "message_stop":
            self.ended = True
        return ""

    def reply(self) -> ModelReply:
        text = "".join(self._parts)
        refusal = text if self._stop == "refusal" else None
        usage = self._usage
        cached = int(usage.get("cache_read_input_tokens") or 0)
        written = int(usage.get("cache_creation_input_tokens") or 0)
        return ModelReply(content=None if refusal else text, refusal=refusal,
                          input_tokens=int(usage.get("input_tokens") or 0) + cached + written,
                          output_tokens=int(usage.get("output_tokens") or 0),
                          cached_input_tokens=cached, service_tier=usage.get("service_tier"),
                          cache_write_tokens=written)


def open_provider(kind: str, base_url: str, api_key: str, model: str, *,
                  extra_headers: Mapping[str, str] | None = None, api_version: str = "",
                  structured: Mapping[str, str] | None = None,
                  retry_after_max: float = RETRY_AFTER_MAX_SECONDS
                  ) -> OpenAIProvider | AnthropicProvider:
    """The gateway's provider of ``kind`` (``openai``, ``azure``, ``anthropic``);
    ``retry_after_max``: the longest retry-after it reports (provider_retry_after_max_
    seconds)."""
    endpoint = Endpoint(kind, base_url, api_key, tuple((extra_headers or {}).items()),
                        api_version)
    if kind == "anthropic":
        return AnthropicProvider(base_url, api_key, model, endpoint=endpoint,
                                 structured=structured, retry_after_max=retry_after_max)
    return OpenAIProvider(base_url, api_key, model, endpoint=endpoint, structured=structured,
                          retry_after_max=retry_after_max)
