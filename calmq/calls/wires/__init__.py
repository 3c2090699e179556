"""The model gateway: one interface over model providers, a module per provider's wire, and
the registry that names them.

Providers: Chat Completions (OpenAI, Azure OpenAI, OpenAI-compatible servers such as vLLM,
Ollama and LiteLLM, and calmq's fake provider: ``openai``) and Anthropic Messages
(``anthropic``). Each module holds its provider's request shapes, stream reading,
structured-output dialect, endpoint and batch API, and declares its ``Wire``: the facts the
rest of calmq reads (its price-table name, whether it has an embeddings API) instead of
naming providers. What the wires share is in ``base`` (the call's values: ``ModelReply``,
``ModelStream``, ``CallScope``, ``ModelClock``), ``http`` (the HTTP client, ``Endpoint``,
``classify_status``, ``retry_after``, ``rate_limits``) and ``batches`` (the batch APIs' base).

The requests are built by hand and checked in the test suite against the official SDKs'
request types (docs/explanation/decisions.md says why not the SDKs); failures become
registered codes (calmq.failure_codes).

A call is answered whole (``complete``) or streamed (``stream``: the provider's
server-sent events), which gives the text as the model writes it and, at the end, the same
``ModelReply`` with the usage the stream reported.

A new provider is its module here, its line in ``WIRES`` and its name in the settings'
``provider`` choices (docs/explanation/architecture.md, "Where a change goes").
"""

from __future__ import annotations

from collections.abc import Mapping

from calmq.calls.wires.anthropic import ANTHROPIC, ANTHROPIC_VERSION, AnthropicProvider
from calmq.calls.wires.base import (
    SERVICE_TIER,
    CallScope,
    Embedder,
    EmbeddingReply,
    ModelClock,
    ModelReply,
    ModelStream,
    Provider,
    Streamer,
    current_clock,
    current_scope,
    enter_scope,
    model_clock,
)
from calmq.calls.wires.batches import MAX_LINE, BatchClient
from calmq.calls.wires.http import (
    RETRY_AFTER_MAX_SECONDS,
    Endpoint,
    HttpProvider,
    RateLimits,
    Wire,
    classify_status,
    rate_limits,
    retry_after,
    structured_outputs,
)
from calmq.calls.wires.openai import AZURE, OPENAI, OpenAIProvider
from calmq.errors import ConfigError

__all__ = [
    "ANTHROPIC_VERSION",
    "RETRY_AFTER_MAX_SECONDS",
    "SERVICE_TIER",
    "WIRES",
    "AnthropicProvider",
    "CallScope",
    "Embedder",
    "EmbeddingReply",
    "Endpoint",
    "HttpProvider",
    "ModelClock",
    "ModelReply",
    "ModelStream",
    "OpenAIProvider",
    "Provider",
    "RateLimits",
    "Streamer",
    "Wire",
    "classify_status",
    "current_clock",
    "current_scope",
    "enter_scope",
    "model_clock",
    "open_batch_client",
    "open_provider",
    "rate_limits",
    "retry_after",
    "structured_outputs",
    "wire",
]

# The providers calmq speaks to, by the name CALMQ_PROVIDER and CALMQ_EMBEDDINGS_PROVIDER take
# (calmq.settings lists the same names).
WIRES: dict[str, Wire] = {w.kind: w for w in (
    OPENAI,
    AZURE,
    ANTHROPIC,
)}


def wire(kind: str) -> Wire:
    """The wire of provider ``kind``; ConfigError for a name no wire has."""
    found = WIRES.get(kind)
    if found is None:
        raise ConfigError(f"no provider {kind!r}: calmq speaks to "
                          f"{', '.join(sorted(WIRES))}")
    return found


def _endpoint(found: Wire, base_url: str, api_key: str,
              extra_headers: Mapping[str, str] | None, api_version: str) -> Endpoint:
    return found.endpoint(base_url, api_key, tuple((extra_headers or {}).items()), api_version)


def open_provider(kind: str, base_url: str, api_key: str, model: str, *,
                  extra_headers: Mapping[str, str] | None = None, api_version: str = "",
                  structured: Mapping[str, str] | None = None,
                  retry_after_max: float = RETRY_AFTER_MAX_SECONDS) -> HttpProvider:
    """The gateway's provider of ``kind`` (a name in ``WIRES``); ``retry_after_max``: the
    longest retry-after it reports (provider_retry_after_max_seconds)."""
    found = wire(kind)
    return found.provider(base_url, api_key, model,
                          endpoint=_endpoint(found, base_url, api_key, extra_headers,
                                             api_version),
                          structured=structured, retry_after_max=retry_after_max)


def open_batch_client(kind: str, base_url: str, api_key: str, model: str, *,
                      extra_headers: Mapping[str, str] | None = None, api_version: str = "",
                      structured: Mapping[str, str] | None = None,
                      max_line: int = MAX_LINE) -> BatchClient:
    """The batch API's client of provider ``kind``; ConfigError when it has none."""
    found = wire(kind)
    if found.batches is None:
        raise ConfigError(f"provider {kind!r} has no batch API: the batch lane cannot use it")
    return found.batches(base_url, api_key, model,
                         endpoint=_endpoint(found, base_url, api_key, extra_headers,
                                            api_version),
                         structured=structured, max_line=max_line)
