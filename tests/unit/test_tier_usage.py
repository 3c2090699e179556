"""The served tier and cached input, from the fake provider's answers through the wires'
usage reading, as the budget meters and prices them."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from calmq.calls.pricing import cost_usd
from calmq.calls.wires import AnthropicProvider, OpenAIProvider
from calmq.calls.wires.anthropic import _AnthropicReading
from calmq.tooling.fake_provider import FakeProviderSettings, build_app

PREFIX = "stable prefix " * 572  # 2,002 tokens as the fake counts them
Client = TestClient[web.Request, web.Application]


@pytest_asyncio.fixture
async def client() -> AsyncIterator[Client]:
    fake: Client = TestClient(TestServer(build_app(FakeProviderSettings())))
    await fake.start_server()
    yield fake
    await fake.close()


async def _answer(client: Client, path: str, body: dict[str, Any]) -> Any:
    headers = {"anthropic-version": "2023-06-01"} if path == "/v1/messages" else {}
    resp = await client.post(path, json=body, headers=headers)
    assert resp.status == 200
    return await resp.json()


async def test_openai_usage_carries_the_served_tier_and_cached_input(client: Client) -> None:
    """A flex call with a prompt_cache_key sent twice: the second reply's usage has the
    tier that served it and the cached tokens, and is priced at flex's cached price."""
    replies = []
    for text in ("first", "second"):
        body = {"model": "gpt-5-mini", "service_tier": "flex", "prompt_cache_key": "wf-1",
                "messages": [{"role": "system", "content": PREFIX},
                             {"role": "user", "content": json.dumps({"text": text})}]}
        replies.append(OpenAIProvider.parse_reply(
            await _answer(client, "/v1/chat/completions", body)))
    first, second = replies
    assert (first.service_tier, first.cached_input_tokens) == ("flex", 0)
    assert (second.service_tier, second.cached_input_tokens) == ("flex", 1920)
    uncached = cost_usd({}, "openai", "gpt-5-mini", second.input_tokens, 0,
                        service_tier=second.service_tier, requested_tier="flex")
    cached = cost_usd({}, "openai", "gpt-5-mini", second.input_tokens, 0,
                      cached_input_tokens=second.cached_input_tokens,
                      service_tier=second.service_tier, requested_tier="flex")
    assert cached < uncached


async def test_anthropic_input_counts_cache_reads_and_writes(client: Client) -> None:
    """Anthropic reports cached reads and writes apart from input_tokens; calmq's input is
    all of the prompt on both calls, and the second's cached part is the read."""
    replies = []
    for text in ("first", "second"):
        body = {"model": "claude-fake", "max_tokens": 64,
                "system": [{"type": "text", "text": PREFIX,
                            "cache_control": {"type": "ephemeral"}}],
                "messages": [{"role": "user", "content": json.dumps({"text": text})}]}
        replies.append(AnthropicProvider.parse_reply(
            await _answer(client, "/v1/messages", body)))
    prompt = [(len(PREFIX) + len(json.dumps({"text": t}))) // 4 for t in ("first", "second")]
    assert [r.input_tokens for r in replies] == prompt
    assert [r.cached_input_tokens for r in replies] == [0, 2002]
    assert {r.service_tier for r in replies} == {"standard"}


@pytest.mark.parametrize("written", [0, 500])
def test_anthropic_cache_writes_count_as_input_whole_or_streamed(written: int) -> None:
    """Cache writes are input, in a whole answer and in a stream's message_start usage."""
    usage = {"input_tokens": 10, "output_tokens": 2, "cache_creation_input_tokens": written,
             "cache_read_input_tokens": 7}
    data = {"type": "message", "content": [{"type": "text", "text": "ok"}],
            "stop_reason": "end_turn", "usage": usage}
    assert AnthropicProvider.parse_reply(data).input_tokens == 17 + written
    reading = _AnthropicReading()
    reading.add("message_start", {"type": "message_start", "message": {"usage": usage}})
    reading.add("message_delta", {"type": "message_delta", "delta": {"stop_reason": "end_turn"},
                                  "usage": {"output_tokens": 2}})
    reading.add("message_stop", {"type": "message_stop"})
    streamed = reading.reply()
    assert (streamed.input_tokens, streamed.cached_input_tokens) == (17 + written, 7)
