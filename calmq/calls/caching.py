"""Prompt caching: a step marks the stable prefix of its prompt, and each provider's request
says it the way that provider caches.

A step marks the message that ends its prompt's stable prefix (the system prompt, a long
document, examples: what is the same on every call of the step, retries and other jobs of
the workflow included) with ``"cache": "prefix"``, or wraps it in ``stable(message)``. The
prefix is every message up to the last marked one. Without a mark a request is sent exactly
as before.

- OpenAI and Azure OpenAI cache every prompt of 1,024 tokens or more by its exact prefix;
  ``prompt_cache_key`` makes the requests that share a prefix land where it is cached. calmq
  sends one key per workflow and tenant: a hash of the two, so no tenant's id or name reaches
  the provider, and tenants never share a key.
- Anthropic caches only up to a block marked ``cache_control``: the last block of the
  marked message carries ``{"type": "ephemeral"}`` (a system message: the system prompt is
  sent as text blocks, the mark on the marked one's block).

The mark never reaches a provider: a message's keys are only ``role`` and ``content`` on
the wire. What a call read from and wrote to the cache comes back in its usage
(``ModelReply.cached_input_tokens``, ``cache_write_tokens``), is recorded per call and job,
and is metered here: the cached tokens and the money the cache saved, per workflow and
tenant.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any, Final

from prometheus_client import Counter

__all__ = ["CACHE_MARK", "PREFIX", "CacheUse", "anthropic_prompt", "cache_key", "cache_use",
           "meter_cache", "openai_prompt", "prefix_length", "stable"]

# The message key that marks the end of the stable prefix, and its value.
CACHE_MARK: Final = "cache"
PREFIX: Final = "prefix"
_EPHEMERAL: Final = {"type": "ephemeral"}


def stable(message: dict[str, str]) -> dict[str, str]:
    """``message`` marked as the last one of the prompt's stable prefix."""
    return {**message, CACHE_MARK: PREFIX}


def prefix_length(messages: list[dict[str, str]]) -> int:
    """How many leading messages are the stable prefix: up to the last marked one (0: no
    mark). A mark of another value is refused: a typo would silently cache nothing."""
    length = 0
    for n, message in enumerate(messages, 1):
        mark = message.get(CACHE_MARK)
        if mark is None:
            continue
        if mark != PREFIX:
            raise ValueError(f"a message's {CACHE_MARK!r} mark is {PREFIX!r}, not {mark!r}")
        length = n
    return length


def _bare(message: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in message.items() if k != CACHE_MARK}


def cache_key(workflow: str, tenant: str) -> str:
    """OpenAI's ``prompt_cache_key`` of a workflow's calls for a tenant: a hash, so that
    neither name leaves calmq, and two tenants never share the provider's cache routing."""
    return _key(workflow, tenant)


@cache
def _key(workflow: str, tenant: str) -> str:
    digest = hashlib.blake2b(f"{workflow}\0{tenant}".encode(), digest_size=16,
                             person=b"calmq-cache-key").hexdigest()
    return f"calmq-{digest}"


def openai_prompt(messages: list[dict[str, str]], workflow: str, tenant: str
                  ) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """The messages as Chat Completions takes them, and the body's cache parameters
    (``prompt_cache_key`` when a prefix is marked; nothing otherwise)."""
    if not prefix_length(messages):
        return messages, {}
    return [_bare(m) for m in messages], {"prompt_cache_key": cache_key(workflow, tenant)}


def anthropic_prompt(messages: list[dict[str, str]]
                     ) -> tuple[str | list[dict[str, Any]], list[dict[str, Any]]]:
    """Messages' ``system`` and ``messages``: the system messages joined (Anthropic takes
    one system prompt), the rest as they are; with a marked prefix, ``cache_control`` on the
    last block of it."""
    length = prefix_length(messages)
    system = [m for m in messages if m["role"] == "system"]
    rest: list[dict[str, Any]] = [_bare(m) for m in messages if m["role"] != "system"]
    if not length:
        return "\n".join(m["content"] for m in system), rest
    last = messages[length - 1]
    if last["role"] == "system":
        # Text blocks, one per system message, in order: the mark on the marked one's.
        blocks: list[dict[str, Any]] = [{"type": "text", "text": m["content"]} for m in system]
        blocks[system.index(last)]["cache_control"] = dict(_EPHEMERAL)
        return blocks, rest
    at = sum(1 for m in messages[:length] if m["role"] != "system") - 1
    rest[at] = {**rest[at], "content": [{"type": "text", "text": last["content"],
                                         "cache_control": dict(_EPHEMERAL)}]}
    return "\n".join(m["content"] for m in system), rest


@dataclass(frozen=True)
class CacheUse:
    """One call's use of the prompt cache: tokens read and written; what the reads saved
    against the same tokens at the input price, and what the writes cost above it (Anthropic
    bills a cache write at 1.25 times its input price). Saved, net: the one less the other."""

    read: int = 0
    written: int = 0
    read_saved_usd: float = 0.0
    write_extra_usd: float = 0.0

    @property
    def saved_usd(self) -> float:
        return self.read_saved_usd - self.write_extra_usd


def cache_use(price: Callable[[int, int], float], read: int, written: int) -> CacheUse:
    """A call's ``CacheUse``; ``price(read, written)``: the call's cost had the provider
    read ``read`` and written ``written`` of its input tokens from and to its cache."""
    if not (read or written):
        return CacheUse()
    plain = price(0, 0)
    writing = price(0, written) if written else plain
    actual = price(read, written) if read else writing
    return CacheUse(read, written, max(0.0, writing - actual), max(0.0, writing - plain))


@cache
def _counters() -> tuple[Counter, Counter, Counter]:
    return (
        Counter("calmq_model_cache_tokens_total",
                "Input tokens the provider read from (read) or wrote to (write) its prompt "
                "cache: a share of calmq_model_tokens_total{direction=\"input\"}",
                ["workflow", "tenant", "provider", "model", "use"]),
        Counter("calmq_model_cache_saved_usd_total",
                "What input read from the prompt cache saved in USD against its input price",
                ["workflow", "tenant", "provider", "model"]),
        Counter("calmq_model_cache_write_cost_usd_total",
                "What writing the prompt cache cost in USD above the input price",
                ["workflow", "tenant", "provider", "model"]),
    )


def meter_cache(labels: tuple[str, str, str, str], use: CacheUse) -> None:
    """Count a call's cache use under (workflow, tenant, provider, model); the series are
    created lazily, at the first call that used a cache."""
    if not (use.read or use.written):
        return
    tokens, saved, extra = _counters()
    if use.read:
        tokens.labels(*labels, "read").inc(use.read)
        saved.labels(*labels).inc(use.read_saved_usd)
    if use.written:
        tokens.labels(*labels, "write").inc(use.written)
        extra.labels(*labels).inc(use.write_extra_usd)
