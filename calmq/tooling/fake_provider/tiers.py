"""Service tiers and prompt caching, as the providers document them: which tier serves a
call, whether flex has room for it, and how much of its prompt the provider's cache holds.

Each rule and where it comes from:

- OpenAI's ``service_tier`` (the SDK's ``completion_create_params``: auto, default, flex,
  scale, priority, fast): the answer names the tier that served the call (the SDK's
  ``ChatCompletion.service_tier``); ``auto`` and ``default`` are served ``default``, and
  ``fast`` is answered ``priority`` ("the response will show service_tier=priority regardless
  of if you specify fast or priority", the SDK's docstring).
- Flex (OpenAI's flex-processing guide): slower answers, and "occasional resource
  unavailability": a 429 the guide calls Resource Unavailable, not charged.
- OpenAI's prompt caching (its prompt-caching guide): automatic for prompts of 1,024 tokens
  or more, hits in steps of 128 tokens of an exact prefix; ``prompt_cache_key`` groups the
  requests that share it; reported as ``usage.prompt_tokens_details.cached_tokens``.
- Anthropic's prompt caching (its prompt-caching guide): only the prefix up to a block
  marked ``cache_control`` is cached (up to four marks, the longest seen prefix is read), at
  least 1,024 tokens; the first call reports it as ``cache_creation_input_tokens``, later
  ones as ``cache_read_input_tokens``, and ``input_tokens`` counts only the rest. A refused
  or failed call (a 503, a 429) writes nothing.

The fake's simplifications: a cached prefix never expires (the real caches keep one for
minutes, or 24 hours with ``prompt_cache_retention``); a token is four characters of the
prompt's text, as everywhere in the fake.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final

__all__ = ["CACHE_MIN_TOKENS", "CACHE_STEP_TOKENS", "FLEX_REFUSAL", "Caching", "FlexShare",
           "openai_served_tier"]

CACHE_MIN_TOKENS: Final = 1024
CACHE_STEP_TOKENS: Final = 128
_CHARS_PER_TOKEN: Final = 4
_KEPT_PREFIXES: Final = 100_000
# OpenAI's flex-processing guide names the refusal "429 Resource Unavailable" and shows no
# body; the body is OpenAI's usual error object with that name as its code.
FLEX_REFUSAL: Final = {
    "message": "Resource unavailable: flex processing has no capacity for this request "
               "now. Retry later, or send it with service_tier 'default'.",
    "type": "server_error", "param": None, "code": "resource_unavailable"}
_OPENAI_SERVED: Final = {"auto": "default", "default": "default", "flex": "flex",
                         "scale": "scale", "priority": "priority", "fast": "priority"}


def openai_served_tier(body: dict[str, Any]) -> str:
    """The tier that serves an OpenAI chat request: ``default`` unless it names another."""
    return _OPENAI_SERVED.get(str(body.get("service_tier") or "auto"), "default")


class FlexShare:
    """Which flex calls are refused for capacity: exactly ``rate`` of them, spread evenly
    (every fifth at 0.2), so a benchmark's share is the setting's, not a draw's."""

    def __init__(self, rate: float) -> None:
        self._rate = rate
        self._owed = 0.0

    def refuse(self) -> bool:
        self._owed += self._rate
        if self._owed >= 1.0 - 1e-9:
            self._owed -= 1.0
            return True
        return False


@dataclass(frozen=True, slots=True)
class Cached:
    """A call's input as the cache saw it: tokens read from it, and tokens written to it;
    ``prefixes``: what the call puts in the cache once it is answered (``Caching.keep``)."""

    read: int = 0
    written: int = 0
    prefixes: tuple[bytes, ...] = ()


def _text(content: Any) -> list[tuple[str, bool]]:
    """A content's text pieces, each with whether its block is marked ``cache_control``."""
    if isinstance(content, str):
        return [(content, False)]
    if isinstance(content, list):
        return [(part["text"], isinstance(part.get("cache_control"), dict))
                for part in content
                if isinstance(part, dict) and isinstance(part.get("text"), str)]
    return []


def _pieces(body: dict[str, Any], *, anthropic: bool) -> list[tuple[str, bool]]:
    """The prompt's text in the order the provider reads it (Anthropic: system first)."""
    pieces = _text(body.get("system")) if anthropic else []
    for message in body.get("messages") or ():
        if isinstance(message, dict):
            pieces.extend(_text(message.get("content")))
    return pieces


class Caching:
    """The prefixes this fake has seen, per model and cache key, and what a call reads."""

    def __init__(self, *, openai_automatic: bool) -> None:
        self._openai_automatic = openai_automatic
        self._seen: OrderedDict[bytes, None] = OrderedDict()

    def clear(self) -> None:
        self._seen.clear()

    def openai(self, body: dict[str, Any]) -> Cached:
        """OpenAI: the longest seen prefix, in 128-token steps from 1,024 tokens. Only for
        requests that name a ``prompt_cache_key`` (or retention), or with the automatic
        caching setting on: a request without them is answered as before caching was
        modelled."""
        if not (self._openai_automatic or body.get("prompt_cache_key")
                or body.get("prompt_cache_retention")):
            return Cached()
        text = "".join(piece for piece, _ in _pieces(body, anthropic=False))
        tokens = len(text) // _CHARS_PER_TOKEN
        ends = range(CACHE_MIN_TOKENS, tokens + 1, CACHE_STEP_TOKENS)
        scope = f"openai\0{body.get('model')}\0{body.get('prompt_cache_key') or ''}"
        read, prefixes = self._longest_seen(scope, text, ends)
        return Cached(read=read, prefixes=prefixes)

    def anthropic(self, body: dict[str, Any]) -> Cached:
        """Anthropic: the prefixes up to each ``cache_control`` mark of 1,024 tokens or
        more; the longest seen is read, the rest up to the last mark is written."""
        text, marks = "", []
        for piece, marked in _pieces(body, anthropic=True):
            text += piece
            if marked and len(text) // _CHARS_PER_TOKEN >= CACHE_MIN_TOKENS:
                marks.append(len(text) // _CHARS_PER_TOKEN)
        if not marks:
            return Cached()
        read, prefixes = self._longest_seen(f"anthropic\0{body.get('model')}", text, marks)
        return Cached(read=read, written=marks[-1] - read, prefixes=prefixes)

    def keep(self, prefixes: Iterable[bytes]) -> None:
        """The prefixes of a call that will be answered are in the cache from now on; a
        call refused or failing (a 503, a 429, a flex refusal) puts nothing there, as a
        provider caches what it processed. (A call that arrives while the first one is
        still running reads it here; at Anthropic an entry is there for others once the
        first response begins: the fake is kinder by a call's latency.)"""
        for key in prefixes:
            self._seen[key] = None
            self._seen.move_to_end(key)
        while len(self._seen) > _KEPT_PREFIXES:
            self._seen.popitem(last=False)

    def _longest_seen(self, scope: str, text: str, ends: Iterable[int]
                      ) -> tuple[int, tuple[bytes, ...]]:
        """The longest of the prefixes ending at ``ends`` (tokens) seen before, and every
        one of them (to keep once the call is answered)."""
        digest = hashlib.blake2b(scope.encode())
        done, longest = 0, 0
        keys: list[bytes] = []
        for end in sorted(set(ends)):
            digest.update(text[done:end * _CHARS_PER_TOKEN].encode())
            done = end * _CHARS_PER_TOKEN
            key = digest.copy().digest()
            keys.append(key)
            if key in self._seen:
                longest = end
        return longest, tuple(keys)
