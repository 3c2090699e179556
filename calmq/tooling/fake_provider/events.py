"""The answers' shapes that are the provider's own: a streamed answer's events (OpenAI's
``chat.completion.chunk`` objects, Anthropic's named events), Anthropic's input usage and
its error types."""

from __future__ import annotations

import json
import time
from typing import Any

from calmq.tooling.fake_provider.calls import Call

__all__ = ["AnthropicEvents", "OpenAIEvents", "anthropic_input", "anthropic_type", "sse"]


def anthropic_type(status: int) -> str:
    return {400: "invalid_request_error", 401: "authentication_error",
            403: "permission_error", 404: "not_found_error", 413: "request_too_large",
            429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
            529: "overloaded_error"}.get(status, "api_error")


def anthropic_input(call: Call) -> dict[str, int]:
    """Anthropic's input usage: ``input_tokens`` counts only what the cache did not hold."""
    return {"input_tokens": call.prompt_tokens - call.cached_tokens - call.cache_written_tokens,
            "cache_creation_input_tokens": call.cache_written_tokens,
            "cache_read_input_tokens": call.cached_tokens}


def sse(payload: dict[str, Any], event: str | None = None) -> bytes:
    data = json.dumps(payload, separators=(",", ":"))
    return (f"event: {event}\ndata: {data}\n\n" if event else f"data: {data}\n\n").encode()


class OpenAIEvents:
    """Chat Completions' stream: ``chat.completion.chunk`` objects, then ``[DONE]``."""

    def __init__(self, call: Call, number: int, *, refusal: bool) -> None:
        self.call = call
        self.refusal = refusal
        self.base: dict[str, Any] = {
            "id": f"chatcmpl-fake-{number}", "object": "chat.completion.chunk",
            "created": int(time.time()), "model": call.model,
            "service_tier": call.served_tier, "system_fingerprint": "fp_fake"}
        if call.include_usage:
            self.base["usage"] = None  # every chunk but the last, as OpenAI sends them

    def _chunk(self, delta: dict[str, Any], finish: str | None = None) -> bytes:
        return sse({**self.base, "choices": [
            {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]})

    def start(self) -> bytes:
        return self._chunk({"role": "assistant", "content": "", "refusal": None})

    def delta(self, token: str) -> bytes:
        return self._chunk({"refusal": token} if self.refusal else {"content": token})

    def error(self) -> bytes:
        return sse({"error": {"message": "The server had an error while processing your "
                               "request. Sorry about that!", "type": "server_error",
                               "param": None, "code": None}})

    def end(self, stop: str, tokens: int) -> bytes:
        out = self._chunk({}, stop)
        if self.call.include_usage:
            prompt = self.call.prompt_tokens
            out += sse({**self.base, "choices": [], "usage": {
                "prompt_tokens": prompt, "completion_tokens": tokens,
                "total_tokens": prompt + tokens,
                "prompt_tokens_details": {"cached_tokens": self.call.cached_tokens,
                                          "audio_tokens": 0},
                "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                              "accepted_prediction_tokens": 0,
                                              "rejected_prediction_tokens": 0}}})
        return out + b"data: [DONE]\n\n"


class AnthropicEvents:
    """Messages' stream: named events, each ``data`` carrying its ``type``."""

    def __init__(self, call: Call, number: int) -> None:
        self.call = call
        self.number = number

    def start(self) -> bytes:
        message: dict[str, Any] = {
            "id": f"msg_fake_{self.number}", "type": "message", "role": "assistant",
            "model": self.call.model, "content": [], "stop_reason": None,
            "stop_sequence": None,
            "usage": {**anthropic_input(self.call), "output_tokens": 1,
                      "service_tier": "standard"}}
        return (sse({"type": "message_start", "message": message}, "message_start")
                + sse({"type": "content_block_start", "index": 0,
                        "content_block": {"type": "text", "text": ""}}, "content_block_start")
                + sse({"type": "ping"}, "ping"))

    def delta(self, token: str) -> bytes:
        return sse({"type": "content_block_delta", "index": 0,
                     "delta": {"type": "text_delta", "text": token}}, "content_block_delta")

    def error(self) -> bytes:
        return sse({"type": "error", "error": {"type": "overloaded_error",
                                                "message": "Overloaded"}}, "error")

    def end(self, stop: str, tokens: int) -> bytes:
        return (sse({"type": "content_block_stop", "index": 0}, "content_block_stop")
                + sse({"type": "message_delta",
                        "delta": {"stop_reason": stop, "stop_sequence": None},
                        "usage": {"output_tokens": tokens}}, "message_delta")
                + sse({"type": "message_stop"}, "message_stop"))
