"""What every provider's wire shares: the HTTP client (``HttpProvider``: one aiohttp session,
a call answered whole or as server-sent events, embeddings in OpenAI's shape), where an API
lives and how it is authenticated (``Endpoint``), the reading of an answer's headers
(``retry_after``, ``rate_limits``), the classification of a refused call into calmq's
failure codes (``classify_status``) and the declaration of a wire (``Wire``), which the
registry (calmq.calls.wires) lists and the rest of calmq reads.

Each provider's own shapes (request body, reply, stream events, structured-output dialect,
batch API) are in its module: ``openai`` (Chat Completions: OpenAI, Azure OpenAI and
OpenAI-compatible servers) and ``anthropic`` (Messages).
"""

from __future__ import annotations

import email.utils
import fnmatch
import json
import math
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from contextlib import aclosing
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import aiohttp

from calmq.calls.wires.base import EmbeddingReply, ModelReply, ModelStream, current_clock
from calmq.errors import StepFailure
from calmq.failure_codes import failure

if TYPE_CHECKING:
    from calmq.calls.wires.batches import BatchClient

__all__ = [
    "RETRY_AFTER_MAX_SECONDS",
    "Endpoint",
    "HttpProvider",
    "RateLimits",
    "StreamReading",
    "Wire",
    "classify_status",
    "rate_limits",
    "retry_after",
    "stream_error",
    "structured_outputs",
]

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
    """Where one provider's API lives and how it is authenticated: by default (OpenAI and
    OpenAI-compatible servers: vLLM, Ollama, LiteLLM) a bearer key and the API's paths under
    ``{base_url}/v1`` (``base_url`` may end in ``/v1`` or not). A wire whose API lives or
    authenticates otherwise declares a subclass (Azure OpenAI's, Anthropic's).
    ``extra_headers`` go on every request (a LiteLLM proxy's or a gateway's own headers)."""

    base_url: str
    api_key: str = ""
    extra_headers: tuple[tuple[str, str], ...] = ()
    api_version: str = ""

    @property
    def api_base(self) -> str:
        """The prefix of the API's paths (``/chat/completions``, ``/files``, ``/batches``)."""
        base = self.base_url.rstrip("/")
        return base if base.endswith("/v1") else base + "/v1"

    def url(self, path: str) -> str:
        """The URL of ``path`` (``/chat/completions``, ``/embeddings``, ``/files``...)."""
        return self.api_base + path

    def auth_headers(self) -> dict[str, str]:
        """The key's headers (none without a key: a local server takes none)."""
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def headers(self) -> dict[str, str]:
        return {**self.auth_headers(), **dict(self.extra_headers)}


STRUCTURED = ("schema", "prompt")


def structured_outputs(model: str, overrides: Mapping[str, str] | None, *,
                       default: bool = True) -> bool:
    """Whether to send the output's schema to this model (``schema``) or only ask in the
    prompt (``prompt``). ``overrides`` maps model names (``fnmatch`` patterns) to either;
    else ``default`` (the wire's ``takes_schema``: every model but Anthropic's Claude 3
    family, which does not support structured outputs)."""
    for pattern, choice in (overrides or {}).items():
        if fnmatch.fnmatchcase(model, pattern):
            return choice == "schema"
    return default


class HttpProvider:
    """A provider's wire over HTTP (the base of each provider's: one aiohttp session per
    provider, reused). A subclass names its ``kind``, its default ``endpoint_type`` and
    builds its own requests and readings."""

    kind: ClassVar[str]
    endpoint_type: ClassVar[type[Endpoint]] = Endpoint

    def __init__(self, base_url: str, api_key: str, model: str, *,
                 endpoint: Endpoint | None = None,
                 structured: Mapping[str, str] | None = None,
                 retry_after_max: float = RETRY_AFTER_MAX_SECONDS) -> None:
        self.endpoint_config = endpoint or self.endpoint_type(base_url, api_key)
        self.retry_after_max = retry_after_max
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.model = model
        self.schema_on = structured_outputs(model, structured,
                                            default=self.takes_schema(model))
        self._session: aiohttp.ClientSession | None = None
        self._derived: dict[int, tuple[dict[str, Any], dict[str, Any]]] = {}
        # Told the status and stated limits of every answer (the budget learns from them).
        self.observer: Observer | None = None

    @staticmethod
    def takes_schema(model: str) -> bool:
        """Whether ``model`` takes the output's schema by default (CALMQ_STRUCTURED_OUTPUTS
        overrides it)."""
        return True

    # What each provider's wire defines: the API's own name of its chat endpoint (a batch's
    # ``endpoint`` and each line's ``url``), the body of a call (a batch request sends the
    # very same) and the reading of a 2xx answer (also a batch result's).
    endpoint: ClassVar[str] = ""
    # The chat endpoint's path under the base URL (``_post``'s and ``_streamed``'s).
    chat_path: ClassVar[str] = ""

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
        return self.parse_reply(await self._post(self.chat_path, body))

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
        return self._streamed(self.chat_path, body, self.stream_reading())

    def request_body(
        self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        raise NotImplementedError

    def stream_body(
        self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        raise NotImplementedError

    @staticmethod
    def stream_reading() -> StreamReading:
        """How the wire's server-sent events read as text deltas, usage and errors."""
        raise NotImplementedError

    @staticmethod
    def parse_reply(data: Any) -> ModelReply:
        raise NotImplementedError

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
        clock = current_clock()
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
        clock = current_clock()
        began = False
        try:
            url = self.endpoint_config.url(path)
            async with self.session().post(url, json=body, headers=headers) as resp:
                if self.observer is not None:
                    self.observer(resp.status, rate_limits(resp.headers))
                if resp.status >= 300:
                    raise await self._refused(resp)
                began = True
                async with aclosing(server_sent_events(resp.content)) as events:
                    async for event in events:
                        yield event
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

    async def _refused(self, resp: aiohttp.ClientResponse) -> StepFailure:
        """The failure of a streamed call the provider refused before its stream began."""
        try:
            text = await resp.text()
        except aiohttp.ClientPayloadError as exc:
            garbled = failure("upstream_garbled", f"the provider's error answer was cut off "
                              f"({resp.status}): {exc}")
            garbled.__cause__ = exc
            return garbled
        return classify_status(resp.status, text, resp.headers,
                               retry_after_max=self.retry_after_max)

    def _streamed(self, path: str, body: dict[str, Any], reading: StreamReading) -> ModelStream:
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


@dataclass(frozen=True)
class Wire:
    """One provider as the rest of calmq knows it: the registry (calmq.calls.wires) maps
    the name ``CALMQ_PROVIDER`` takes to its wire, and the pricing, the stack and ``calmq
    provider check`` read these facts instead of naming providers.

    ``provider``: its online wire; ``endpoint``: where its API lives and how it is
    authenticated; ``batches``: its batch API's client (None: it has none); ``price_table``:
    its provider id in the genai-prices table (None: priced by CALMQ_PRICES only);
    ``embeddings``: whether it has an embeddings API (``POST /v1/embeddings``)."""

    kind: str
    provider: type[HttpProvider]
    endpoint: type[Endpoint] = Endpoint
    batches: type[BatchClient] | None = None
    price_table: str | None = None
    embeddings: bool = True


class StreamReading(Protocol):
    """How one provider's stream events add up to deltas and a reply."""

    ended: bool

    def add(self, event: str, payload: Any) -> str: ...

    def reply(self) -> ModelReply: ...


def stream_error(payload: Any) -> StepFailure:
    """An error event in the middle of a stream (Anthropic's ``event: error``, OpenAI's
    ``{"error": ...}`` chunk): the stream broke off after it began."""
    error = payload.get("error") if isinstance(payload, dict) else None
    kind = error.get("type") if isinstance(error, dict) else None
    message = error.get("message") if isinstance(error, dict) else None
    return failure("stream_interrupted", f"the provider broke off its stream: {kind}: "
                   f"{str(message)[:200]}")


async def server_sent_events(content: aiohttp.StreamReader
                             ) -> AsyncGenerator[tuple[str, str], None]:
    """The server-sent events of a response's body, as (event, data): the ``data`` lines of
    one event joined, comments (keep-alives) skipped."""
    event, data = "", list[str]()
    # Lines end at b"\n", so a UTF-8 character never straddles two of them.
    async for raw in content:
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
