"""The model gateway: one interface over model providers, and the classification of their
answers into calmq's failure classes.

Providers: OpenAI-compatible Chat Completions (OpenAI, vLLM, Ollama, LiteLLM, and calmq's
fake provider) and Anthropic Messages. One aiohttp session per provider, reused.
"""

from __future__ import annotations

import json
import time
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import aiohttp

from calmq.errors import FailureClass, StepFailure

__all__ = [
    "AnthropicProvider",
    "CallScope",
    "Embedder",
    "EmbeddingReply",
    "ModelClock",
    "ModelReply",
    "OpenAIProvider",
    "Provider",
    "classify_status",
    "current_clock",
    "current_scope",
    "enter_scope",
    "model_clock",
    "open_provider",
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
    priority: str = "bulk"


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

    def add_usage(self, input_tokens: int, output_tokens: int, cost_usd: float) -> None:
        self.calls += 1
        self.input_tokens += input_tokens
        self.output_tokens += output_tokens
        self.cost_usd += cost_usd


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


@dataclass(frozen=True)
class EmbeddingReply:
    vectors: list[list[float]]
    input_tokens: int


@runtime_checkable
class Embedder(Protocol):
    """A provider that also embeds text (OpenAI-compatible ``POST /v1/embeddings``)."""

    async def embed(self, *, inputs: list[str], job_id: str) -> EmbeddingReply: ...


def _retry_after(headers: Any) -> float | None:
    raw = headers.get("Retry-After") if headers is not None else None
    if raw is None:
        return None
    try:
        return max(0.0, float(raw))
    except ValueError:
        return None  # an HTTP date: rare from model APIs; the backoff floor still applies


# How OpenAI, Azure OpenAI and LiteLLM name a request refused by their content policy.
_POLICY_MARKS = ("content_policy", "content_filter")


def classify_status(status: int, body: str, headers: Any = None) -> StepFailure:
    """Turn a provider's non-2xx answer into a StepFailure with its failure class."""
    detail = body[:300]
    if status == 429:
        return StepFailure(
            f"rate limited by the provider: {detail}", code="rate_limited",
            failure_class=FailureClass.TRANSIENT, retry_after=_retry_after(headers),
        )
    if status >= 500:
        return StepFailure(
            f"provider answered {status}: {detail}", code="upstream_unavailable",
            failure_class=FailureClass.TRANSIENT, retry_after=_retry_after(headers),
        )
    if status == 400 and any(mark in body for mark in _POLICY_MARKS):
        return StepFailure(
            f"the provider refused the content: {detail}", code="content_policy",
            failure_class=FailureClass.POLICY,
        )
    if status in (401, 403):
        return StepFailure(
            f"provider refused the credentials ({status}): {detail}", code="provider_permission",
            failure_class=FailureClass.PERMISSION,
        )
    if status == 408:
        return StepFailure("provider timed out", code="timeout",
                           failure_class=FailureClass.TRANSIENT)
    return StepFailure(
        f"provider rejected the request ({status}): {detail}", code="provider_bad_request",
        failure_class=FailureClass.INPUT,
    )


class _HttpProvider:
    kind = "openai"

    def __init__(self, base_url: str, api_key: str, model: str) -> None:
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.model = model
        self._session: aiohttp.ClientSession | None = None

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

    async def _post(self, path: str, body: dict[str, Any], headers: dict[str, str]) -> Any:
        from calmq.tracing import current_traceparent

        traceparent = current_traceparent()
        if traceparent:  # the job's trace goes on to the provider (W3C trace context)
            headers = {**headers, "traceparent": traceparent}
        started = time.monotonic()
        clock = _CLOCK.get()
        try:
            url = self.base_url + path
            async with self.session().post(url, json=body, headers=headers) as resp:
                text = await resp.text()
                if resp.status >= 300:
                    raise classify_status(resp.status, text, resp.headers)
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as exc:
            raise StepFailure(
                f"cannot reach the provider: {exc}", code="connection_error",
                failure_class=FailureClass.TRANSIENT,
            ) from exc
        except TimeoutError as exc:
            raise StepFailure("provider timed out", code="timeout",
                              failure_class=FailureClass.TRANSIENT) from exc
        finally:
            if clock is not None:
                clock.seconds += time.monotonic() - started
        try:
            return json.loads(text)
        except ValueError as exc:
            raise StepFailure(
                "provider answered 2xx with a body that is not JSON", code="upstream_garbled",
                failure_class=FailureClass.TRANSIENT,
            ) from exc


    async def embed(self, *, inputs: list[str], job_id: str) -> EmbeddingReply:
        """Embeddings in the OpenAI shape, which vLLM, Ollama and LiteLLM also serve."""
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        data = await self._post("/v1/embeddings",
                                {"model": self.model, "input": inputs, "user": job_id}, headers)
        try:
            rows = sorted(data["data"], key=lambda r: int(r["index"]))
            vectors = [[float(x) for x in r["embedding"]] for r in rows]
            usage = data.get("usage") or {}
            return EmbeddingReply(vectors, int(usage.get("prompt_tokens", 0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise StepFailure("provider answer lacks data[].embedding", code="upstream_garbled",
                              failure_class=FailureClass.TRANSIENT) from exc


class OpenAIProvider(_HttpProvider):
    """OpenAI-compatible Chat Completions (``POST {base}/v1/chat/completions``)."""

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
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return self.parse_reply(await self._post(self.endpoint, body, headers))

    endpoint = "/v1/chat/completions"

    def request_body(
        self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The body of the call; a provider batch sends the very same (calmq.batches)."""
        # max_completion_tokens, not the deprecated max_tokens: reasoning models (o1, o3, ...)
        # answer 400 to max_tokens, which calmq would dead-letter as an input error.
        body: dict[str, Any] = {
            "model": self.model, "messages": messages, "user": job_id,
            "max_completion_tokens": max_tokens,
        }
        if response_schema is not None:
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": "output", "schema": response_schema, "strict": True},
            }
        return body

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
            return ModelReply(
                content=message.get("content"),
                refusal=refusal,
                input_tokens=int(usage.get("prompt_tokens", 0)),
                output_tokens=int(usage.get("completion_tokens", 0)),
            )
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise StepFailure(
                "provider answer lacks choices[0].message", code="upstream_garbled",
                failure_class=FailureClass.TRANSIENT,
            ) from exc


class AnthropicProvider(_HttpProvider):
    """Anthropic Messages (``POST {base}/v1/messages``)."""

    kind = "anthropic"

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
        headers = {"x-api-key": self.api_key, "anthropic-version": "2023-06-01"}
        return self.parse_reply(await self._post(self.endpoint, body, headers))

    endpoint = "/v1/messages"

    def request_body(
        self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The body of the call (a batch request's ``params``); the schema is not sent."""
        system = "\n".join(m["content"] for m in messages if m["role"] == "system")
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": max_tokens,
            "messages": [m for m in messages if m["role"] != "system"],
            "metadata": {"user_id": job_id},
        }
        if system:
            body["system"] = system
        return body

    @staticmethod
    def parse_reply(data: Any) -> ModelReply:
        """A 2xx answer's reply (also a batch result's ``message``)."""
        try:
            text = "".join(b.get("text", "") for b in data["content"] if b.get("type") == "text")
            usage = data.get("usage") or {}
            refusal = text if data.get("stop_reason") == "refusal" else None
            return ModelReply(
                content=None if refusal else text,
                refusal=refusal,
                input_tokens=int(usage.get("input_tokens", 0)),
                output_tokens=int(usage.get("output_tokens", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise StepFailure(
                "provider answer lacks content", code="upstream_garbled",
                failure_class=FailureClass.TRANSIENT,
            ) from exc


def open_provider(kind: str, base_url: str, api_key: str, model: str) -> Provider:
    if kind == "anthropic":
        return AnthropicProvider(base_url, api_key, model)
    return OpenAIProvider(base_url, api_key, model)
