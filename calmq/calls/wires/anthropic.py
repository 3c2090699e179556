"""Anthropic Messages (``POST {base}/v1/messages``): the request, the reply and the stream
(``stream: true``: ``message_start``, text deltas, ``message_delta``, ``message_stop``), the
structured-output dialect, the ``x-api-key`` endpoint and the Message Batches API
(``POST /v1/messages/batches``, a JSONL ``results_url``). Anthropic has no embeddings API.

Structured outputs (``output_config.format``): every object gets
``additionalProperties: false``; numeric and length constraints, which it does not support,
go into the description.
"""

from __future__ import annotations

import copy
import json
from datetime import datetime
from typing import Any, Final

import aiohttp

from calmq.calls import caching
from calmq.calls.output_schemas import with_note
from calmq.calls.wires.base import EmbeddingReply, ModelReply
from calmq.calls.wires.batches import BatchClient, BatchResult, BatchView, not_run, refusal
from calmq.calls.wires.http import (
    Endpoint,
    HttpProvider,
    StreamReading,
    Wire,
    classify_status,
    stream_error,
)
from calmq.errors import InfrastructureError, StepFailure
from calmq.failure_codes import failure

__all__ = ["ANTHROPIC", "ANTHROPIC_VERSION", "AnthropicBatches", "AnthropicEndpoint",
           "AnthropicProvider", "anthropic_schema"]

ANTHROPIC_VERSION = "2023-06-01"


# What Anthropic's structured outputs support.
_ANTHROPIC_KEEP: Final = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "anyOf", "allOf",
    "enum", "const", "$ref", "$defs", "definitions", "description", "title", "format",
    "default", "pattern", "minItems"})
_ANTHROPIC_FORMATS: Final = frozenset({"date-time", "time", "date", "duration", "email",
                                       "hostname", "ipv4", "ipv6", "uuid", "uri"})


def anthropic_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` in the dialect of Anthropic's ``output_config.format`` (a new dict)."""
    return _anthropic_node(copy.deepcopy(schema))


def _anthropic_node(node: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    dropped: dict[str, Any] = {}
    for key, value in node.items():
        unsupported = ((key == "format" and value not in _ANTHROPIC_FORMATS)
                       or (key == "minItems" and value not in (0, 1)))
        if unsupported:
            dropped[key] = value
        elif key in _ANTHROPIC_KEEP:
            out[key] = value
        else:
            dropped[key] = value
    for defs_key in ("$defs", "definitions"):
        if isinstance(out.get(defs_key), dict):
            out[defs_key] = {n: _anthropic_node(s) for n, s in out[defs_key].items()}
    if out.get("type") == "object" or isinstance(out.get("properties"), dict):
        out["properties"] = {k: _anthropic_node(s)
                             for k, s in (out.get("properties") or {}).items()}
        out["additionalProperties"] = False
    if isinstance(out.get("items"), dict):
        out["items"] = _anthropic_node(out["items"])
    for key in ("anyOf", "allOf"):
        if isinstance(out.get(key), list):
            out[key] = [_anthropic_node(s) for s in out[key]]
    with_note(out, dropped)
    return out


class AnthropicEndpoint(Endpoint):
    """Anthropic's API: the key in ``x-api-key``, and the API's version on every request."""

    def auth_headers(self) -> dict[str, str]:
        return {"x-api-key": self.api_key, "anthropic-version": ANTHROPIC_VERSION}



class AnthropicProvider(HttpProvider):
    """Anthropic Messages (``POST {base}/v1/messages``)."""

    kind = "anthropic"
    endpoint_type = AnthropicEndpoint
    endpoint = "/v1/messages"
    chat_path = "/messages"

    @staticmethod
    def takes_schema(model: str) -> bool:
        return not model.startswith("claude-3")  # the Claude 3 family takes no schema

    @staticmethod
    def stream_reading() -> StreamReading:
        return _AnthropicReading()

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
            raise stream_error(payload)
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



# Anthropic's limits per batch (requests, bytes of requests).
ANTHROPIC_LIMITS = (100_000, 256 * 1024 * 1024)


# Anthropic's error types and the HTTP status each stands for (to classify like online).
_ANTHROPIC_STATUS = {"invalid_request_error": 400, "authentication_error": 401,
                     "permission_error": 403, "not_found_error": 404,
                     "request_too_large": 413, "rate_limit_error": 429, "api_error": 500,
                     "overloaded_error": 529}


class AnthropicBatches(BatchClient):
    """Anthropic's Message Batches: the requests in the create call, results from
    ``results_url``. Its batches carry no metadata: a batch created but not recorded is
    found again as the one unrecorded batch of the same size created since (``find``)."""

    kind = "anthropic"
    limits = ANTHROPIC_LIMITS
    batches_path = "/messages/batches"
    online = AnthropicProvider

    def line(self, custom_id: str, body: dict[str, Any]) -> bytes:
        return json.dumps({"custom_id": custom_id, "params": body},
                          separators=(",", ":")).encode()

    async def create(self, lines: list[bytes], key: str) -> BatchView:
        body = b'{"requests":[' + b",".join(lines) + b"]}"
        return self._view(await self._post_raw(body))

    async def _post_raw(self, body: bytes) -> Any:
        headers = {**self.headers(), "content-type": "application/json"}
        url = self.api.url("/messages/batches")
        try:
            async with self.session().post(url, data=body, headers=headers) as resp:
                text = await resp.text()
                if resp.status >= 300:
                    raise refusal("POST", "/v1/messages/batches", resp.status, text)
                return json.loads(text)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise InfrastructureError(f"POST /v1/messages/batches: {exc}") from exc

    async def find(self, key: str, since: datetime, count: int,
                   known: set[str]) -> str | None:
        page = await self._json("GET", "/messages/batches", params={"limit": "100"})
        floor = since.timestamp() - 5
        found = []
        for item in page.get("data", []):
            created = datetime.fromisoformat(str(item["created_at"]).replace("Z", "+00:00"))
            total = sum(int(v) for v in (item.get("request_counts") or {}).values())
            if (str(item["id"]) not in known and created.timestamp() >= floor
                    and total == count):
                found.append(str(item["id"]))
        return found[-1] if found else None  # the oldest such: the first one made

    async def view(self, provider_id: str) -> BatchView:
        return self._view(await self._json("GET", f"/messages/batches/{provider_id}"))

    def _view(self, data: dict[str, Any]) -> BatchView:
        status = str(data.get("processing_status"))
        counts = {k: int(v) for k, v in (data.get("request_counts") or {}).items()}
        outcome = None
        if status == "ended":
            outcome = ("cancelled" if data.get("cancel_initiated_at") else
                       "expired" if counts.get("expired") else "completed")
        url = data.get("results_url")
        return BatchView(str(data["id"]), status, outcome, counts, (str(url),) if url else ())

    async def delete(self, view: BatchView) -> None:
        # The batch and its results go together; only an ended batch can be deleted.
        await self._json("DELETE", f"/messages/batches/{view.provider_id}", missing_ok=True)

    def _result(self, line: bytes) -> BatchResult:
        item = json.loads(line)
        if not isinstance(item, dict) or not isinstance(item.get("custom_id"), str):
            raise TypeError("no custom_id")
        cid = str(item.get("custom_id"))
        result = item.get("result") or {}
        kind = result.get("type")
        if kind == "succeeded":
            try:
                return BatchResult(cid, reply=self._online.parse_reply(result.get("message")))
            except StepFailure as failure:
                return BatchResult(cid, failure=failure)
        if kind == "errored":
            error = result.get("error") or {}
            nested = error.get("error")
            inner: dict[str, Any] = nested if isinstance(nested, dict) else error
            status = _ANTHROPIC_STATUS.get(str(inner.get("type")), 500)
            return BatchResult(cid, failure=classify_status(status, json.dumps(error), None))
        return BatchResult(cid, failure=not_run(
            "batch_expired" if kind == "expired" else "batch_cancelled"))

    async def cancel(self, provider_id: str) -> None:
        await self._json("POST", f"/messages/batches/{provider_id}/cancel")


ANTHROPIC = Wire("anthropic", AnthropicProvider, AnthropicEndpoint, AnthropicBatches,
                 price_table="anthropic", embeddings=False)
