"""Chat Completions (``POST {base}/v1/chat/completions``): OpenAI, Azure OpenAI and
OpenAI-compatible servers (vLLM, Ollama, LiteLLM, calmq's fake provider): the request, the
reply and the stream (``stream: true`` with ``stream_options.include_usage``), the strict
structured-output dialect, Azure's endpoint and OpenAI's Batch API (a JSONL file of requests,
``POST /v1/batches``, output and error files).

Structured outputs, strict mode (``response_format.json_schema.strict = true``): every object
gets ``additionalProperties: false`` and lists every property in ``required``; a property
that was optional becomes nullable (``anyOf [..., {"type": "null"}]``) and loses its
``default``; keywords strict mode does not support (``minLength``, ``maxLength``, ...) are
taken out and written into the description, where the model still reads them; ``$ref``
siblings are unravelled; the name matches ``^[a-zA-Z0-9_-]{1,64}$``.
"""

from __future__ import annotations

import copy
import json
import re
from datetime import datetime
from typing import Any, Final

import aiohttp

from calmq.calls import caching
from calmq.calls.output_schemas import with_note
from calmq.calls.wires.base import SERVICE_TIER, ModelReply, current_scope
from calmq.calls.wires.batches import (
    BatchClient,
    BatchRefused,
    BatchResult,
    BatchView,
    LineError,
    TooLong,
    named,
    not_run,
)
from calmq.calls.wires.http import (
    Endpoint,
    HttpProvider,
    StreamReading,
    Wire,
    classify_status,
    stream_error,
)
from calmq.errors import StepFailure
from calmq.failure_codes import failure

__all__ = ["AZURE", "OPENAI", "AzureEndpoint", "OpenAIBatches", "OpenAIProvider",
           "openai_schema_name", "openai_strict_schema"]


_NAME_BAD: Final = re.compile(r"[^a-zA-Z0-9_-]")
# What OpenAI's strict mode supports besides structure (Structured Outputs guide).
_OPENAI_KEEP: Final = frozenset({
    "type", "properties", "required", "additionalProperties", "items", "anyOf", "enum",
    "const", "$ref", "$defs", "definitions", "description", "title", "pattern", "format",
    "multipleOf", "maximum", "exclusiveMaximum", "minimum", "exclusiveMinimum", "minItems",
    "maxItems"})
_OPENAI_FORMATS: Final = frozenset({"date-time", "time", "date", "duration", "email",
                                    "hostname", "ipv4", "ipv6", "uuid"})


def openai_schema_name(schema: dict[str, Any]) -> str:
    """The schema's title as OpenAI takes a name (``^[a-zA-Z0-9_-]{1,64}$``)."""
    title = schema.get("title")
    name = _NAME_BAD.sub("_", title)[:64] if isinstance(title, str) and title else "output"
    return name or "output"



def _resolve(root: dict[str, Any], ref: str) -> dict[str, Any]:
    node: Any = root
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return dict(node)


def openai_strict_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` in OpenAI's strict dialect (a new dict; ``schema`` is not changed)."""
    root = copy.deepcopy(schema)
    return _openai_node(root, root, nullable=False)


def _openai_node(node: dict[str, Any], root: dict[str, Any], *, nullable: bool
                 ) -> dict[str, Any]:
    ref = node.get("$ref")
    if isinstance(ref, str) and len(node) > 1:
        # A $ref with siblings (a description, a default): OpenAI takes a bare $ref only.
        node = {**_resolve(root, ref), **{k: v for k, v in node.items() if k != "$ref"}}
    out: dict[str, Any] = {}
    dropped: dict[str, Any] = {}
    for key, value in node.items():
        if key == "default":
            continue  # strict mode fills every property; a default says nothing more
        if key == "format" and value not in _OPENAI_FORMATS:
            dropped[key] = value
        elif key in _OPENAI_KEEP:
            out[key] = value
        else:
            dropped[key] = value
    for defs_key in ("$defs", "definitions"):
        if isinstance(out.get(defs_key), dict):
            out[defs_key] = {name: _openai_node(sub, root, nullable=False)
                             for name, sub in out[defs_key].items()}
    if out.get("type") == "object" or isinstance(out.get("properties"), dict):
        properties = out.get("properties") or {}
        required = set(out.get("required") or [])
        out["properties"] = {
            key: _openai_node(sub, root, nullable=key not in required)
            for key, sub in properties.items()}
        out["required"] = list(properties)
        out["additionalProperties"] = False
        out.setdefault("type", "object")
    if isinstance(out.get("items"), dict):
        out["items"] = _openai_node(out["items"], root, nullable=False)
    if isinstance(out.get("anyOf"), list):
        out["anyOf"] = [_openai_node(sub, root, nullable=False) for sub in out["anyOf"]]
    with_note(out, dropped)
    if nullable and not _allows_null(out):
        meta: dict[str, Any] = {k: out.pop(k) for k in ("description", "title") if k in out}
        out = {"anyOf": [out, {"type": "null"}], **meta}
    return out


def _allows_null(node: dict[str, Any]) -> bool:
    kinds = node.get("type")
    if kinds == "null" or (isinstance(kinds, list) and "null" in kinds):
        return True
    return any(isinstance(s, dict) and s.get("type") == "null"
               for s in node.get("anyOf") or [])



class OpenAIProvider(HttpProvider):
    """Chat Completions (``POST {base}/v1/chat/completions``): OpenAI, Azure OpenAI and
    OpenAI-compatible servers."""

    kind = "openai"
    # The API's own name of the endpoint (a batch's ``endpoint`` and each line's ``url``).
    endpoint = "/v1/chat/completions"
    chat_path = "/chat/completions"

    def request_body(
        self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
        response_schema: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The body of the call; a provider batch sends the very same (``OpenAIBatches``)."""
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

    @staticmethod
    def stream_reading() -> StreamReading:
        return _OpenAIReading()

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
            raise stream_error(payload)
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



class AzureEndpoint(Endpoint):
    """Azure OpenAI: the ``api-key`` header; the v1 API at
    ``https://RESOURCE.openai.azure.com/openai/v1`` or a deployment URL
    ``.../openai/deployments/NAME`` with ``api_version``."""

    @property
    def deployment(self) -> bool:
        return "/openai/deployments/" in self.base_url

    @property
    def api_base(self) -> str:
        base = self.base_url.rstrip("/")
        if self.deployment:
            return base.split("/openai/deployments/")[0] + "/openai/v1"
        return base if base.endswith("/openai/v1") else base + "/openai/v1"

    def url(self, path: str) -> str:
        if self.deployment and path in ("/chat/completions", "/embeddings"):
            query = f"?api-version={self.api_version}" if self.api_version else ""
            return self.base_url.rstrip("/") + path + query
        return self.api_base + path

    def auth_headers(self) -> dict[str, str]:
        return {"api-key": self.api_key} if self.api_key else {}



# OpenAI's limits per batch (requests, bytes of requests).
OPENAI_LIMITS = (50_000, 200 * 1024 * 1024)


class OpenAIBatches(BatchClient):
    """OpenAI's Batch API: upload the JSONL (purpose ``batch``), create the batch with a
    ``24h`` completion window and calmq's key in its ``metadata``, read the output file and
    the error file."""

    kind = "openai"
    limits = OPENAI_LIMITS
    batches_path = "/batches"
    online = OpenAIProvider
    # "failed": the input file failed validation, no request ran (not "expired": its jobs
    # are not all to blame; the errors name the lines).
    _STATUS = {"completed": "completed", "expired": "expired", "cancelled": "cancelled",
               "failed": "failed"}

    def line(self, custom_id: str, body: dict[str, Any]) -> bytes:
        return json.dumps({"custom_id": custom_id, "method": "POST", "url": self.endpoint,
                           "body": body}, separators=(",", ":")).encode() + b"\n"

    async def create(self, lines: list[bytes], key: str) -> BatchView:
        form = aiohttp.FormData()
        form.add_field("purpose", "batch")
        form.add_field("file", b"".join(lines), filename=f"calmq-{key}.jsonl",
                       content_type="application/jsonl")
        uploaded = await self._json("POST", "/files", data=form)
        try:
            created = await self._json("POST", "/batches", json={
                "input_file_id": uploaded["id"], "endpoint": self.endpoint,
                "completion_window": "24h", "metadata": {"calmq_key": key}})
        except BatchRefused:
            # No batch holds the uploaded file: it must not stay with the provider.
            await self._delete_file(str(uploaded["id"]))
            raise
        return self._view(created)

    async def find(self, key: str, since: datetime, count: int,
                   known: set[str]) -> str | None:
        after: str | None = None
        floor = since.timestamp() - 300  # clocks differ
        while True:
            page = await self._json("GET", "/batches",
                                    params={"limit": "100", **({"after": after} if after else {})})
            for item in page.get("data", []):
                if (item.get("metadata") or {}).get("calmq_key") == key:
                    return str(item["id"])
                if int(item.get("created_at") or 0) < floor:
                    return None
            if not page.get("has_more") or not page.get("last_id"):
                return None
            after = str(page["last_id"])

    async def view(self, provider_id: str) -> BatchView:
        return self._view(await self._json("GET", f"/batches/{provider_id}"))

    def _view(self, data: dict[str, Any]) -> BatchView:
        status = str(data.get("status"))
        counts = {k: int(v) for k, v in (data.get("request_counts") or {}).items()}
        files = tuple(str(f) for f in (data.get("output_file_id"), data.get("error_file_id"))
                      if f)
        errors = tuple(
            LineError(str(e.get("message") or ""), e.get("code"),
                      int(e["line"]) if isinstance(e.get("line"), int) else None)
            for e in ((data.get("errors") or {}).get("data") or []) if isinstance(e, dict))
        return BatchView(str(data["id"]), status, self._STATUS.get(status), counts, files,
                         str(data["input_file_id"]) if data.get("input_file_id") else None,
                         errors)

    async def _delete_file(self, file_id: str) -> None:
        await self._json("DELETE", f"/files/{file_id}", missing_ok=True)

    async def delete(self, view: BatchView) -> None:
        for file_id in (view.input_file, *view.results):
            if file_id:
                await self._delete_file(file_id)

    def _download(self, result: str) -> str:
        return f"/files/{result}/content"

    async def input_custom_ids(self, view: BatchView, lines: set[int]) -> dict[int, str]:
        found: dict[int, str] = {}
        if not view.input_file or not lines:
            return found
        number = 0
        async for line in self._lines(f"/files/{view.input_file}/content"):
            number += 1  # blank lines are not yielded: calmq's input files have none
            if number in lines:
                found[number] = named(line.head if isinstance(line, TooLong) else line)
            if number >= max(lines):
                break
        return found

    def _result(self, line: bytes) -> BatchResult:
        item = json.loads(line)
        if not isinstance(item, dict) or not isinstance(item.get("custom_id"), str):
            raise TypeError("no custom_id")
        cid = str(item.get("custom_id"))
        response = item.get("response")
        error = item.get("error")
        if response is None:
            code = str((error or {}).get("code") or "batch_request_failed")
            if code in ("batch_expired", "batch_cancelled"):
                return BatchResult(cid, failure=not_run(code))
            return BatchResult(cid, failure=classify_status(400, json.dumps(error), None))
        status = int(response.get("status_code") or 500)
        body = response.get("body")
        if status >= 300:
            return BatchResult(cid, failure=classify_status(status, json.dumps(body), None))
        try:
            return BatchResult(cid, reply=self._online.parse_reply(body))
        except StepFailure as failure:
            return BatchResult(cid, failure=failure)

    async def cancel(self, provider_id: str) -> None:
        await self._json("POST", f"/batches/{provider_id}/cancel")



# The registry's entries (calmq.calls.wires): Azure OpenAI bills OpenAI's prices, and its
# batches are OpenAI's Batch API at its own endpoint.
OPENAI = Wire("openai", OpenAIProvider, Endpoint, OpenAIBatches, price_table="openai")
AZURE = Wire("azure", OpenAIProvider, AzureEndpoint, OpenAIBatches, price_table="openai")
