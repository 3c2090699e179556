"""The model call: every layer between a step and a provider's API, in one package.

The chain, innermost first: a provider's wire (``wires``: a module per provider, Chat
Completions and Anthropic Messages with their embeddings, structured-output dialects and batch
APIs; ``batch_apis``: the batch APIs' names), the provider gate (``gate``: blocks,
pauses, stated limits), the budget, quota and meter (``budget``, ``quota``, ``meter``, priced
by ``pricing``; ``budgeted_provider`` wraps a provider with the three),
fallback across a step's models (``fallback``), a concurrency key's rate limits
(``key_rates``) and the streamed-output publisher (``publishing``). ``output_schemas``
reads a step's answer against its output model (``read_answer``).

The names below are the package's public API. They load on first use (PEP 562): the settings
model reads ``calmq.calls.pricing``, and importing it must not pull in the HTTP client, the
budget or the data layer.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from calmq.calls.budgeted_provider import BudgetedProvider
    from calmq.calls.gate import ProviderGate
    from calmq.calls.meter import estimate_prompt_tokens
    from calmq.calls.output_schemas import read_answer
    from calmq.calls.pricing import ModelPrice
    from calmq.calls.publishing import OutputWriter, Position
    from calmq.calls.quota import TenantQuota
    from calmq.calls.stack import open_metered_provider, open_model, open_step_models
    from calmq.calls.wires import (
        CallScope,
        Embedder,
        EmbeddingReply,
        ModelReply,
        ModelStream,
        Provider,
        RateLimits,
        Streamer,
    )

# public name -> the module that defines it
_HOMES = {
    "BudgetedProvider": "budgeted_provider",
    "TenantQuota": "quota",
    "estimate_prompt_tokens": "meter",
    "ProviderGate": "gate",
    "OutputWriter": "publishing",
    "Position": "publishing",
    "open_metered_provider": "stack",
    "open_model": "stack",
    "open_step_models": "stack",
    "read_answer": "output_schemas",
    "ModelPrice": "pricing",
    "CallScope": "wires",
    "Embedder": "wires",
    "EmbeddingReply": "wires",
    "ModelReply": "wires",
    "ModelStream": "wires",
    "Provider": "wires",
    "RateLimits": "wires",
    "Streamer": "wires",
}

__all__ = [
    "BudgetedProvider",
    "CallScope",
    "Embedder",
    "EmbeddingReply",
    "ModelPrice",
    "ModelReply",
    "ModelStream",
    "OutputWriter",
    "Position",
    "Provider",
    "ProviderGate",
    "RateLimits",
    "Streamer",
    "TenantQuota",
    "estimate_prompt_tokens",
    "open_metered_provider",
    "open_model",
    "open_step_models",
    "read_answer",
]


def __getattr__(name: str) -> object:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{home}"), name)
