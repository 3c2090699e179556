"""The providers' batch APIs, by the names the batch lane imports: the shared base is
calmq.calls.wires.batches, each provider's client is in its wire's module
(calmq.calls.wires.openai: OpenAI's Batch API; calmq.calls.wires.anthropic: Anthropic's
Message Batches), and ``open_batch_client`` picks one through the wires' registry."""

from __future__ import annotations

from calmq.calls.wires import open_batch_client
from calmq.calls.wires.anthropic import AnthropicBatches
from calmq.calls.wires.batches import (
    MAX_LINE,
    BatchClient,
    BatchRefused,
    BatchResult,
    BatchView,
    LineError,
    custom_id,
    parse_custom_id,
)
from calmq.calls.wires.openai import OpenAIBatches

__all__ = ["MAX_LINE", "AnthropicBatches", "BatchClient", "BatchRefused", "BatchResult",
           "BatchView", "LineError", "OpenAIBatches", "custom_id", "open_batch_client",
           "parse_custom_id"]
