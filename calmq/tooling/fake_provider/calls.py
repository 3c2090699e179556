"""A model call as the fake reads it (the job, its mode and knobs, the prompt's size), and
the answers it gives: summaries, invoice fields, embedding vectors."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, Final

from aiohttp import web

__all__ = ["BadRequest", "Call", "draft_text", "format_seconds", "invoice_json", "parse_call",
           "result_json", "step_mode", "summary_json", "tokens_of", "vector"]

SUCCESS_CONFIDENCE: Final = 0.97
MALFORMED_TEXT: Final = "Sorry, here is a summary without JSON"
REFUSAL_TEXT: Final = "I can't help with that"
JOB_HEADER: Final = "X-Calmq-Job-Id"
_SUMMARY_WORDS: Final = 12
_DEFAULT_FAIL_TIMES: Final = 2
_DEFAULT_DRAFT_TOKENS: Final = 60
_MAX_DRAFT_TOKENS: Final = 20_000
_EMBEDDING_DIMENSIONS: Final = 8


class BadRequest(Exception):
    """The request itself is unusable; answered with 400 invalid_request_error."""

    def __init__(self, message: str, code: str = "invalid_request") -> None:
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(slots=True)
class Call:
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

    # The output's JSON schema, when the request sent one (response_format / output_config).
    schema: dict[str, Any] | None = None
    # Streamed (``stream: true``), and with OpenAI's ``stream_options.include_usage``.
    stream: bool = False
    include_usage: bool = False
    # The system prompt asks for a plain-text draft (calmq/workflows/draft.py): answer
    # ``tokens`` words of prose instead of a summary.
    draft: bool = False
    tokens: int = _DEFAULT_DRAFT_TOKENS
    # Per-call stream pace (input ``ttft_ms``, ``tokens_per_second``); None: the settings'.
    ttft_seconds: float | None = None
    tokens_per_second: float | None = None
    # Set by the online endpoints (tiers.py): the tier that serves the call (OpenAI's answer
    # names it), and the prompt tokens read from / written to the provider's prompt cache.
    served_tier: str = "default"
    cached_tokens: int = 0
    cache_written_tokens: int = 0
    # The prefixes the call puts in the cache once answered (tiers.Caching.keep).
    cache_prefixes: tuple[bytes, ...] = ()


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
        raise BadRequest(f"step input field {key!r} must be a non-negative integer")
    return value


def parse_call(body: Any, request: web.Request, *, anthropic: bool) -> Call:
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("'messages' must be a non-empty array", "invalid_messages")
    system_text = _text_of(body.get("system")) if anthropic else ""
    total_chars = len(system_text)
    last_user: str | None = None
    for message in messages:
        if not isinstance(message, dict):
            raise BadRequest("every message must be an object", "invalid_messages")
        text = _text_of(message.get("content"))
        total_chars += len(text)
        if message.get("role") == "user":
            last_user = text
        elif message.get("role") == "system":
            system_text += text
    if last_user is None:
        raise BadRequest("no user message to answer", "invalid_messages")

    # OpenAI's current name is max_completion_tokens; older clients and Anthropic send
    # max_tokens. Either bounds the answer and counts against tokens_per_minute.
    max_tokens = body.get("max_tokens", body.get("max_completion_tokens"))
    if max_tokens is not None and (
        isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1
    ):
        raise BadRequest("'max_tokens' must be a positive integer", "invalid_max_tokens")

    if anthropic:
        metadata = body.get("metadata")
        job_id = metadata.get("user_id") if isinstance(metadata, dict) else None
    else:
        job_id = body.get("user")
    if not isinstance(job_id, str) or not job_id:
        job_id = request.headers.get(JOB_HEADER, "")

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
            raise BadRequest("step input field 'mode' must be a string", "invalid_mode")
        raw_text = step.get("text", "")
        raw_text = step.get("prompt", raw_text) if "text" not in step else raw_text
        text = raw_text if isinstance(raw_text, str) else json.dumps(raw_text)
        fail_times = _non_negative_int(step, "fail_times", _DEFAULT_FAIL_TIMES)
        delay_ms = _non_negative_int(step, "delay_ms", 0)
        tokens = min(_non_negative_int(step, "tokens", _DEFAULT_DRAFT_TOKENS),
                     _MAX_DRAFT_TOKENS) or 1
        ttft_ms = step.get("ttft_ms")
        ttft = _non_negative_int(step, "ttft_ms", 0) / 1000 if ttft_ms is not None else None
        rate = step.get("tokens_per_second")
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, int | float)
                                 or rate <= 0):
            raise BadRequest("step input field 'tokens_per_second' must be a positive number")
    else:
        mode, text, fail_times, delay_ms = "success", last_user, _DEFAULT_FAIL_TIMES, 0
        tokens, ttft, rate = _DEFAULT_DRAFT_TOKENS, None, None

    model = body.get("model")
    schema = _schema_of(body, anthropic=anthropic)
    return Call(
        anthropic=anthropic,
        model=model if isinstance(model, str) else "",
        job_id=job_id,
        mode=mode,
        text=text,
        fail_times=fail_times,
        delay_seconds=delay_ms / 1000,
        prompt_tokens=max(1, total_chars // 4),
        max_tokens=max_tokens,
        invoice="invoice fields" in system_text.lower() or _asks_invoice(schema),
        schema=schema,
        stream=body.get("stream") is True,
        include_usage=body.get("stream") is True and isinstance(
            body.get("stream_options"), dict) and body["stream_options"].get(
            "include_usage") is True,
        draft=schema is None and "plain-text draft" in system_text.lower(),
        tokens=tokens,
        ttft_seconds=ttft,
        tokens_per_second=float(rate) if rate is not None else None,
    )


def _schema_of(body: dict[str, Any], *, anthropic: bool) -> dict[str, Any] | None:
    if anthropic:
        fmt = (body.get("output_config") or {}).get("format")
        schema = fmt.get("schema") if isinstance(fmt, dict) else None
    else:
        fmt = body.get("response_format")
        spec = fmt.get("json_schema") if isinstance(fmt, dict) else None
        schema = spec.get("schema") if isinstance(spec, dict) else None
    return schema if isinstance(schema, dict) else None


def _asks_invoice(schema: dict[str, Any] | None) -> bool:
    return schema is not None and "vendor" in (schema.get("properties") or {})



_INVOICE_PATTERNS: Final = {
    "vendor": re.compile(r"(?im)^\s*(?:vendor|from|seller)\s*[:#]\s*(.+?)\s*$"),
    "invoice_number": re.compile(r"(?im)\binvoice\s*(?:no\.?|number|#)?\s*[:#]\s*(\S+)"),
    "total": re.compile(
        r"(?im)^\s*(?:total|amount due)\s*[:#]?\s*([A-Z]{3})?\s*([0-9][0-9,]*(?:\.[0-9]+)?)"),
}


def invoice_json(text: str, confidence: float) -> str:
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


def result_json(call: Call, confidence: float) -> str:
    if call.draft:
        return draft_text(call.text, call.tokens)
    return (invoice_json(call.text, confidence) if call.invoice
            else summary_json(call.text, confidence))


def draft_text(text: str, tokens: int) -> str:
    """``tokens`` words of prose from the prompt's words, in turn (deterministic): a word is
    a token, as the fake counts them."""
    words = text.split(maxsplit=64)[:64] or ["draft"]
    return " ".join(words[n % len(words)] for n in range(tokens))


def tokens_of(call: Call, content: str) -> list[str]:
    """The answer as the model would write it, token by token: a draft's words (each after
    its space), anything else in pieces of four characters (about a token of JSON)."""
    if call.draft:
        words = content.split(" ")
        return [words[0], *(" " + w for w in words[1:])]
    return [content[n:n + 4] for n in range(0, len(content), 4)] or [""]


def summary_json(text: str, confidence: float) -> str:
    # maxsplit bounds the work for huge inputs: only the first words are ever needed.
    words = text.split(maxsplit=_SUMMARY_WORDS)[:_SUMMARY_WORDS]
    return json.dumps({"summary": " ".join(words), "confidence": confidence})




def vector(text: str) -> list[float]:

    digest = hashlib.sha256(text.encode()).digest()
    raw = [b - 127.5 for b in digest[:_EMBEDDING_DIMENSIONS]]
    norm = math.sqrt(sum(x * x for x in raw)) or 1.0
    return [round(x / norm, 6) for x in raw]


def format_seconds(seconds: float) -> str:
    return str(int(seconds)) if seconds == int(seconds) else f"{seconds:g}"



def step_mode(body: Any) -> str | None:
    """The ``mode`` of the step input a chat or message body's last user message holds (a
    batch line's body), or None."""
    messages = body.get("messages") if isinstance(body, dict) else None
    if not isinstance(messages, list):
        return None
    users = [m for m in messages if isinstance(m, dict) and m.get("role") == "user"]
    text = _text_of(users[-1].get("content")) if users else ""
    try:
        step = json.loads(text) if text.lstrip().startswith("{") else None
    except ValueError:
        return None
    mode = step.get("mode") if isinstance(step, dict) else None
    return mode if isinstance(mode, str) else None
