"""What the real APIs refuse: each request body checked against the official SDKs' request
types and the providers' documented rules, answered with the real error bodies.

- OpenAI's Structured Outputs in strict mode accept a subset of JSON Schema: the root is an
  object, every object has ``additionalProperties: false`` and lists every property in
  ``required`` (an optional field is nullable instead), a fixed list of keywords is not
  supported, string formats are a fixed set, at most 10 levels of nesting and 5,000
  properties, and the schema's name matches ``^[a-zA-Z0-9_-]{1,64}$``.
- Anthropic's structured outputs (``output_config.format``) accept a similar subset: every
  object says ``additionalProperties: false``, no numeric or string-length constraints,
  ``minItems`` only 0 or 1; and only the models that support them (not the Claude 3 family).

The error bodies are the providers': ``{"error": {"message", "type", "param", "code"}}``
(OpenAI) and ``{"type": "error", "error": {"type", "message"}}`` (Anthropic).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import re
from dataclasses import dataclass
from functools import cache
from typing import Any, Final

from calmq.tooling.fake_provider.sdk_types import SdkMissing, check

__all__ = [
    "Refusal",
    "anthropic_batch",
    "anthropic_messages",
    "anthropic_schema_problems",
    "openai_batch_create",
    "openai_batch_line",
    "openai_chat",
    "openai_embeddings",
    "openai_file_purpose",
    "openai_strict_problems",
    "ready",
    "start_warming",
    "warm",
]

SCHEMA_NAME: Final = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# OpenAI's strict mode: keywords it does not support (Structured Outputs guide).
_OPENAI_UNSUPPORTED: Final = frozenset({
    "minLength", "maxLength", "patternProperties", "unevaluatedProperties", "propertyNames",
    "minProperties", "maxProperties", "unevaluatedItems", "contains", "minContains",
    "maxContains", "uniqueItems", "allOf", "oneOf", "not", "dependentRequired",
    "dependentSchemas", "if", "then", "else"})
_OPENAI_FORMATS: Final = frozenset({"date-time", "time", "date", "duration", "email",
                                    "hostname", "ipv4", "ipv6", "uuid"})
_OPENAI_MAX_DEPTH: Final = 10
_OPENAI_MAX_PROPERTIES: Final = 5000
# Anthropic's structured outputs: constraints it does not support (structured outputs docs).
_ANTHROPIC_UNSUPPORTED: Final = frozenset({
    "minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf", "minLength",
    "maxLength", "maxItems", "uniqueItems", "contains", "patternProperties", "propertyNames",
    "minProperties", "maxProperties", "not", "if", "then", "else"})
_ANTHROPIC_FORMATS: Final = _OPENAI_FORMATS | {"uri"}


@dataclass(frozen=True)
class Refusal:
    """A request the real API refuses: its status and error body's fields."""

    status: int
    message: str
    kind: str = "invalid_request_error"  # OpenAI's error.type / Anthropic's error.type
    param: str | None = None
    code: str | None = None


@cache
def _types() -> dict[str, Any]:
    try:
        from anthropic.types.message_create_params import (
            MessageCreateParamsNonStreaming as AnthropicMessage,
        )
        from anthropic.types.message_create_params import (
            MessageCreateParamsStreaming as AnthropicStream,
        )
        from anthropic.types.messages.batch_create_params import (
            BatchCreateParams as AnthropicBatch,
        )
        from openai.types.batch_create_params import BatchCreateParams
        from openai.types.chat.completion_create_params import (
            CompletionCreateParamsNonStreaming,
            CompletionCreateParamsStreaming,
        )
        from openai.types.embedding_create_params import EmbeddingCreateParams
        from openai.types.file_purpose import FilePurpose
    except ImportError as exc:  # pragma: no cover - the fake's extra is missing
        raise SdkMissing("the fake provider checks requests with the official SDKs: "
                         "pip install 'calmq[fake]' (openai and anthropic)") from exc
    return {"chat": CompletionCreateParamsNonStreaming,
            "chat_stream": CompletionCreateParamsStreaming, "embeddings": EmbeddingCreateParams,
            "batch": BatchCreateParams, "purpose": FilePurpose, "messages": AnthropicMessage,
            "messages_stream": AnthropicStream, "anthropic_batch": AnthropicBatch}


def _unknown_or_type(problems: list[str], anthropic: bool) -> Refusal:
    first = problems[0]
    if not anthropic and "unknown parameter" in first:
        name = first.split(":", 1)[0].removeprefix("body.")
        return Refusal(400, f"Unrecognized request argument supplied: {name}", param=name)
    if anthropic and "unknown parameter" in first:
        name = first.split(":", 1)[0].removeprefix("body.")
        return Refusal(400, f"{name}: Extra inputs are not permitted")
    if anthropic:
        return Refusal(400, first.removeprefix("body."))
    where = first.split(":", 1)[0].removeprefix("body.")
    return Refusal(400, f"Invalid value for '{where}': {first.split(':', 1)[1].strip()}",
                   param=where, code="invalid_value")


_warming: concurrent.futures.Future[None] | None = None


def start_warming() -> None:
    """``warm`` in a thread, from the server's start: the SDKs' import takes seconds on a
    loaded machine, and must hold neither the start (the server answers /healthz at once)
    nor the event loop (a call arriving meanwhile awaits ``ready``)."""
    global _warming
    if _warming is None:
        pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="sdk-warm")
        _warming = pool.submit(warm)
        pool.shutdown(wait=False)


async def ready() -> None:
    """Wait (without blocking the loop) until the SDKs' types are loaded."""
    if _warming is not None and not _warming.done():
        await asyncio.wrap_future(_warming)


def warm() -> None:
    """Import the SDKs' types and walk one request of each kind."""
    openai_chat({"model": "m", "messages": [{"role": "user", "content": "x"}],
                 "response_format": {"type": "json_schema", "json_schema": {
                     "name": "w", "strict": True, "schema": {
                         "type": "object", "properties": {}, "required": [],
                         "additionalProperties": False}}}})
    openai_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
                 "stream_options": {"include_usage": True}})
    anthropic_messages({"model": "m", "max_tokens": 1, "stream": True,
                        "messages": [{"role": "user", "content": "x"}]})
    openai_embeddings({"model": "m", "input": ["x"]})
    openai_batch_create({"input_file_id": "f", "endpoint": "/v1/chat/completions",
                         "completion_window": "24h"})
    anthropic_batch({"requests": [{"custom_id": "w", "params": {
        "model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}}]})


# -- OpenAI ------------------------------------------------------------------------------

def openai_strict_problems(schema: Any) -> list[str]:
    """Why OpenAI's strict mode refuses ``schema`` (empty: it accepts it)."""
    problems: list[str] = []
    if not isinstance(schema, dict) or schema.get("type") != "object":
        return ["the root schema must be an object ('type': 'object'), not anyOf"]
    counter = [0]
    _openai_node(schema, (), problems, counter)
    if counter[0] > _OPENAI_MAX_PROPERTIES:
        problems.append(f"at most {_OPENAI_MAX_PROPERTIES} object properties in total, "
                        f"found {counter[0]}")
    return problems


def _context(path: tuple[str, ...]) -> str:
    return "context=(" + ", ".join(repr(p) for p in path) + (",)" if len(path) == 1 else ")")


def _openai_node(node: Any, path: tuple[str, ...], out: list[str], counter: list[int],
                 depth: int = 0) -> None:
    if not isinstance(node, dict):
        out.append(f"In {_context(path)}, a schema must be an object")
        return
    if depth > _OPENAI_MAX_DEPTH:
        out.append(f"In {_context(path)}, more than {_OPENAI_MAX_DEPTH} levels of nesting")
        return
    for key in sorted(_OPENAI_UNSUPPORTED & node.keys()):
        out.append(f"In {_context(path)}, '{key}' is not permitted.")
    fmt = node.get("format")
    if fmt is not None and fmt not in _OPENAI_FORMATS:
        out.append(f"In {_context(path)}, format '{fmt}' is not supported.")
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith(("#/$defs/",
                                                                    "#/definitions/"))):
        out.append(f"In {_context(path)}, $ref '{ref}' must point into $defs")
    for defs_key in ("$defs", "definitions"):
        defs = node.get(defs_key)
        if isinstance(defs, dict):
            for name, sub in defs.items():
                _openai_node(sub, (*path, defs_key, name), out, counter, depth)
    kinds = node.get("type")
    is_object = kinds == "object" or (isinstance(kinds, list) and "object" in kinds)
    properties = node.get("properties")
    if is_object or isinstance(properties, dict):
        if node.get("additionalProperties") is not False:
            out.append(f"In {_context(path)}, 'additionalProperties' is required to be "
                       "supplied and to be false.")
        props = properties if isinstance(properties, dict) else {}
        required = node.get("required")
        missing = [k for k in props if not isinstance(required, list) or k not in required]
        if missing:
            out.append(f"In {_context(path)}, 'required' is required to be supplied and to "
                       "be an array including every key in properties. Missing "
                       f"'{missing[0]}'.")
        counter[0] += len(props)
        for key, sub in props.items():
            _openai_node(sub, (*path, "properties", key), out, counter, depth + 1)
    items = node.get("items")
    if isinstance(items, dict):
        _openai_node(items, (*path, "items"), out, counter, depth + 1)
    any_of = node.get("anyOf")
    if isinstance(any_of, list):
        for n, sub in enumerate(any_of):
            _openai_node(sub, (*path, "anyOf", str(n)), out, counter, depth + 1)


def _response_format(body: dict[str, Any]) -> Refusal | None:
    fmt = body.get("response_format")
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return None
    spec = fmt.get("json_schema") or {}
    name = spec.get("name", "")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        return Refusal(400, "Invalid 'response_format.json_schema.name': string does not "
                       "match pattern. Expected a string that matches the pattern "
                       "'^[a-zA-Z0-9_-]+$'.", param="response_format.json_schema.name",
                       code="invalid_value")
    if spec.get("strict") is True:
        problems = openai_strict_problems(spec.get("schema"))
        if problems:
            return Refusal(400, f"Invalid schema for response_format '{name}': {problems[0]}",
                           param="response_format")
    return None


def openai_chat(body: Any) -> Refusal | None:
    """``POST /v1/chat/completions``: the SDK's ``CompletionCreateParamsNonStreaming`` (or
    ``CompletionCreateParamsStreaming`` for ``stream: true``) and the strict Structured
    Outputs rules; ``stream_options`` without ``stream: true`` is refused, as OpenAI does."""
    if not isinstance(body, dict):
        return Refusal(400, "We could not parse the JSON body of your request.")
    streamed = body.get("stream") is True
    if not streamed and body.get("stream_options") is not None:
        return Refusal(400, "The 'stream_options' parameter is only allowed when 'stream' is "
                       "enabled.", param="stream_options")
    problems = check(body, _types()["chat_stream" if streamed else "chat"])
    if problems:
        return _unknown_or_type(problems, anthropic=False)
    if body.get("max_tokens") is not None and body.get("max_completion_tokens") is not None:
        return Refusal(400, "max_tokens and max_completion_tokens cannot both be set",
                       param="max_tokens")
    return _response_format(body)


def openai_embeddings(body: Any) -> Refusal | None:
    if not isinstance(body, dict):
        return Refusal(400, "We could not parse the JSON body of your request.")
    problems = check(body, _types()["embeddings"])
    if problems:
        return _unknown_or_type(problems, anthropic=False)
    if body.get("input") in ("", []):
        return Refusal(400, "'input' : input must be a non-empty string or array",
                       param="input")
    return None


def openai_file_purpose(purpose: str) -> Refusal | None:
    problems = check(purpose, _types()["purpose"], "purpose")
    if problems or purpose != "batch":
        return Refusal(400, f"Invalid value for 'purpose': {purpose!r}; a batch input file "
                       "is uploaded with purpose 'batch'.", param="purpose")
    return None


def openai_batch_create(body: Any) -> Refusal | None:
    if not isinstance(body, dict):
        return Refusal(400, "We could not parse the JSON body of your request.")
    problems = check(body, _types()["batch"])
    if problems:
        return _unknown_or_type(problems, anthropic=False)
    metadata = body.get("metadata") or {}
    if len(metadata) > 16 or any(len(k) > 64 or not isinstance(v, str) or len(v) > 512
                                 for k, v in metadata.items()):
        return Refusal(400, "metadata: at most 16 keys of 64 characters, string values of "
                       "512", param="metadata")
    return None


_LINE_KEYS: Final = frozenset({"custom_id", "method", "url", "body"})


def openai_batch_line(item: Any, endpoint: str) -> str | None:
    """Why one line of a batch input file is refused (OpenAI's Batch API input format:
    ``custom_id``, ``method: POST``, ``url`` = the batch's endpoint, ``body``)."""
    if not isinstance(item, dict):
        return "each line must be a JSON object"
    if set(item) != _LINE_KEYS:
        return f"each line has exactly {sorted(_LINE_KEYS)}; this one has {sorted(item)}"
    if item["method"] != "POST" or item["url"] != endpoint:
        return f"method must be POST and url the batch's endpoint {endpoint}"
    if not isinstance(item["custom_id"], str) or not item["custom_id"]:
        return "custom_id must be a non-empty string"
    if isinstance(item["body"], dict) and item["body"].get("stream") is True:
        return "a batch request cannot stream (stream: true)"
    refusal = (openai_chat(item["body"]) if endpoint == "/v1/chat/completions"
               else openai_embeddings(item["body"]))
    return refusal.message if refusal is not None else None


# -- Anthropic ---------------------------------------------------------------------------

def anthropic_schema_problems(schema: Any) -> list[str]:
    """Why Anthropic's structured outputs refuse ``schema`` (empty: accepted)."""
    problems: list[str] = []
    _anthropic_node(schema, "", problems)
    return problems


def _anthropic_node(node: Any, path: str, out: list[str]) -> None:
    if not isinstance(node, dict):
        out.append(f"{path or 'schema'}: a schema must be an object")
        return
    where = path or "schema"
    for key in sorted(_ANTHROPIC_UNSUPPORTED & node.keys()):
        out.append(f"{where}: '{key}' is not supported in structured outputs")
    fmt = node.get("format")
    if fmt is not None and fmt not in _ANTHROPIC_FORMATS and fmt != "text":
        out.append(f"{where}: format '{fmt}' is not supported")
    min_items = node.get("minItems")
    if min_items is not None and min_items not in (0, 1):
        out.append(f"{where}: minItems other than 0 or 1 is not supported")
    kinds = node.get("type")
    if kinds == "object" or isinstance(node.get("properties"), dict):
        if node.get("additionalProperties") is not False:
            out.append(f"{where}: For 'object' type, 'additionalProperties' must be "
                       "explicitly set to false")
        for key, sub in (node.get("properties") or {}).items():
            _anthropic_node(sub, f"{where}.properties.{key}", out)
    for defs_key in ("$defs", "definitions"):
        for name, sub in (node.get(defs_key) or {}).items():
            _anthropic_node(sub, f"{where}.{defs_key}.{name}", out)
    if isinstance(node.get("items"), dict):
        _anthropic_node(node["items"], f"{where}.items", out)
    for key in ("anyOf", "allOf"):
        for n, sub in enumerate(node.get(key) or []):
            _anthropic_node(sub, f"{where}.{key}.{n}", out)


def supports_output_format(model: str) -> bool:
    """Whether the model takes ``output_config.format`` (the Claude 3 family does not)."""
    return not model.startswith("claude-3")


def anthropic_messages(body: Any) -> Refusal | None:
    """``POST /v1/messages``: the SDK's ``MessageCreateParamsNonStreaming`` (or
    ``MessageCreateParamsStreaming`` for ``stream: true``) and the structured-outputs
    rules."""
    if not isinstance(body, dict):
        return Refusal(400, "messages: the body must be a JSON object")
    problems = check(body, _types()["messages_stream" if body.get("stream") is True
                                    else "messages"])
    if problems:
        return _unknown_or_type(problems, anthropic=True)
    fmt = (body.get("output_config") or {}).get("format")
    if isinstance(fmt, dict):
        model = str(body.get("model", ""))
        if not supports_output_format(model):
            return Refusal(400, f"output_config.format: structured outputs are not "
                           f"supported for model {model}")
        problems = anthropic_schema_problems(fmt.get("schema"))
        if problems:
            return Refusal(400, f"output_config.format.schema: {problems[0]}")
    return None


def anthropic_batch(body: Any) -> Refusal | None:
    """``POST /v1/messages/batches``: the SDK's ``BatchCreateParams``; each request's
    ``params`` as a message, ``custom_id`` matching ``^[a-zA-Z0-9_-]{1,64}$``."""
    if not isinstance(body, dict):
        return Refusal(400, "the body must be a JSON object")
    problems = check(body, _types()["anthropic_batch"])
    if problems:
        return _unknown_or_type(problems, anthropic=True)
    for n, item in enumerate(body.get("requests") or []):
        if not SCHEMA_NAME.match(item["custom_id"]):
            return Refusal(400, f"requests.{n}.custom_id: String should match pattern "
                           "'^[a-zA-Z0-9_-]{1,64}$'")
        refusal = anthropic_messages(item["params"])
        if refusal is not None:
            return Refusal(400, f"requests.{n}.params: {refusal.message}")
    return None
