"""The per-job modes of the chat endpoints (settings.MODES, chosen by the job's input or by
``/admin/mode``): the text each answers with and the delay each adds. Online serves them."""

from __future__ import annotations

from typing import Final

from calmq.tooling.fake_provider.calls import (
    MALFORMED_TEXT,
    REFUSAL_TEXT,
    SUCCESS_CONFIDENCE,
    Call,
    result_json,
)
from calmq.tooling.fake_provider.settings import FakeProviderSettings

__all__ = ["COUNTED_MODES", "VALID_RESULT_MODES", "content", "extra_delay"]

# Modes whose 200 answer carries a result that satisfies the summary schema.
VALID_RESULT_MODES: Final = frozenset({"success", "slow", "flaky", "low_confidence",
                                        "stream_break", "stream_error"})
# Modes that fail the first fail_times calls of a job (counted on arrival).
COUNTED_MODES: Final = frozenset({"flaky", "stream_break", "stream_error"})
# Modes whose answer, when there is one, is the schema's result at full confidence.
_RESULT_MODES: Final = ("success", "slow", "flaky", "timeout", "truncated", "stream_break",
                        "stream_error")


def content(mode: str, call: Call, settings: FakeProviderSettings) -> str | None:
    """The text the mode answers with; None for a mode that only fails."""
    if mode in _RESULT_MODES:
        return result_json(call, SUCCESS_CONFIDENCE)
    if mode == "low_confidence":
        return result_json(call, settings.low_confidence)
    if mode == "malformed":
        return MALFORMED_TEXT
    if mode == "refusal":
        return REFUSAL_TEXT
    return None


def extra_delay(mode: str, settings: FakeProviderSettings) -> float:
    """The seconds the mode adds to the call's latency."""
    if mode == "slow":
        return settings.slow_seconds
    if mode == "timeout":
        return 24 * 3600.0  # never answers: the caller's timeout ends the call
    return 0.0
