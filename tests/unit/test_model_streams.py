"""Streamed model calls: the gateway's streams against the fake provider over real HTTP (both
APIs' event formats, read through the SDKs' own event types), how a stream that breaks off
fails, and the budget settling a stream with the usage it reported."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp.test_utils import TestServer
from anthropic.types import RawMessageStreamEvent
from openai.types.chat import ChatCompletionChunk
from pydantic import TypeAdapter

from calmq.calls.budget import TokenBudget
from calmq.calls.budgeted_provider import BudgetedProvider
from calmq.calls.wires import CallScope, ModelReply, ModelStream, enter_scope, open_provider
from calmq.errors import FailureClass, StepFailure
from calmq.tooling.fake_provider import FakeProviderSettings, build_app
from tests.unit.test_budget import LIMITS, MemoryLedger

Fake = Callable[..., Awaitable[str]]
DRAFT = "Write a plain-text draft that answers the user's request."


@pytest_asyncio.fixture
async def fake() -> AsyncIterator[Fake]:
    servers: list[TestServer] = []

    async def start(**settings: Any) -> str:
        server = TestServer(build_app(FakeProviderSettings(**settings)))
        await server.start_server()
        servers.append(server)
        return str(server.make_url("")).rstrip("/")

    yield start
    for server in servers:
        await server.close()


def _draft(**step: Any) -> list[dict[str, str]]:
    return [{"role": "system", "content": DRAFT},
            {"role": "user", "content": json.dumps({"prompt": "queues carry slow work",
                                                    **step})}]


def _model(kind: str) -> str:
    return "claude-sonnet-4-5" if kind == "anthropic" else "fake-small"


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_a_stream_yields_the_text_as_written_and_its_usage(fake: Fake, kind: str) -> None:
    """Deltas arrive one token at a time; their concatenation is the reply's content, and
    the reply carries the usage the stream reported (OpenAI's include_usage chunk,
    Anthropic's message_start and message_delta)."""
    provider = open_provider(kind, await fake(), "k", _model(kind))
    try:
        stream = provider.stream(messages=_draft(tokens=12), job_id="j1", max_tokens=100)
        deltas = [text async for text in stream]
        reply = await stream.final()
    finally:
        await provider.close()
    assert len(deltas) == 12
    assert "".join(deltas) == reply.content
    assert reply.content == " ".join(["queues", "carry", "slow", "work"] * 3)
    assert reply.output_tokens == 12
    assert reply.input_tokens > 0


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
@pytest.mark.parametrize("mode", ["stream_break", "stream_error"])
async def test_a_stream_that_breaks_off_is_transient(fake: Fake, kind: str, mode: str) -> None:
    """A stream cut half way (the connection, or the provider's error event) fails as
    stream_interrupted, transient, after the deltas it gave; the next call streams whole."""
    provider = open_provider(kind, await fake(), "k", _model(kind))
    try:
        got: list[str] = []

        async def read() -> None:
            async for text in provider.stream(messages=_draft(tokens=10, mode=mode,
                                                              fail_times=1),
                                              job_id=f"j-{mode}", max_tokens=100):
                got.append(text)

        with pytest.raises(StepFailure) as caught:
            await read()
        again = await provider.stream(messages=_draft(tokens=10, mode=mode, fail_times=1),
                                      job_id=f"j-{mode}", max_tokens=100).final()
    finally:
        await provider.close()
    assert caught.value.code == "stream_interrupted"
    assert caught.value.failure_class is FailureClass.TRANSIENT
    assert 0 < len(got) < 10
    assert again.output_tokens == 10


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_a_stream_refused_before_it_began_fails_as_a_call_would(
        fake: Fake, kind: str) -> None:
    """A 429 or 503 to a streamed call is the same failure as to a whole one."""
    provider = open_provider(kind, await fake(retry_after_seconds=2), "k", _model(kind))
    try:
        for mode, code in (("rate_limited", "rate_limited"),
                           ("always_fail", "upstream_unavailable")):
            with pytest.raises(StepFailure) as caught:
                await provider.stream(messages=_draft(mode=mode), job_id="j",
                                      max_tokens=10).final()
            assert caught.value.code in (code, "provider_overloaded"), mode
        refused = await provider.stream(messages=_draft(mode="refusal"), job_id="j",
                                        max_tokens=50).final()
    finally:
        await provider.close()
    assert refused.refusal
    assert refused.content is None


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_the_fakes_stream_is_the_apis_own_event_format(fake: Fake, kind: str) -> None:
    """Every event of the fake's stream reads as the SDK's own stream event type (OpenAI's
    ChatCompletionChunk then [DONE]; Anthropic's message_start, content_block_start,
    content_block_delta, content_block_stop, message_delta, message_stop, and ping), and the
    time to the first token and the pace follow the settings."""
    base = await fake(stream_ttft_ms=200, stream_tokens_per_second=100)
    provider = open_provider(kind, base, "k", _model(kind))
    body = provider.stream_body(messages=_draft(tokens=20), job_id="j", max_tokens=100)
    path = "/v1/messages" if kind == "anthropic" else "/v1/chat/completions"
    events: list[tuple[str, str]] = []
    first_token: float | None = None
    started = time.monotonic()
    async with aiohttp.ClientSession() as session, session.post(
            base + path, json=body, headers=provider.endpoint_config.headers()) as resp:
        assert resp.status == 200
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        event = ""
        async for raw in resp.content:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                events.append((event, line[6:]))
                if first_token is None and ('"text_delta"' in line or (
                        '"content":"' in line and '"content":""' not in line)):
                    first_token = time.monotonic()
    ended = time.monotonic()
    await provider.close()
    assert first_token is not None
    # Lower bounds only: the fake waits at least this long, however loaded the machine is.
    assert first_token - started >= 0.2
    assert ended - started >= 0.2 + 19 / 100
    if kind == "openai":
        assert events[-1] == ("", "[DONE]")
        chunks = [ChatCompletionChunk.model_validate_json(d) for _e, d in events[:-1]]
        assert chunks[-1].choices == []
        assert chunks[-1].usage is not None
        assert chunks[-1].usage.completion_tokens == 20
        assert chunks[-2].choices[0].finish_reason == "stop"
    else:
        # ping is an event the API sends and the SDK skips (not a RawMessageStreamEvent).
        assert ("ping", '{"type":"ping"}') in events
        adapter: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)
        parsed = [adapter.validate_json(d) for e, d in events if e != "ping"]
        kinds = [p.type for p in parsed]
        assert [e for e, _d in events if e != "ping"] == kinds
        assert kinds[:2] == ["message_start", "content_block_start"]
        assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
        assert kinds.count("content_block_delta") == 20
        assert parsed[-2].usage.output_tokens == 20


async def test_the_fake_refuses_stream_options_without_stream(fake: Fake) -> None:
    """stream_options on a call that does not stream is OpenAI's 400, in its error body."""
    base = await fake()
    provider = open_provider("openai", base, "k", "fake-small")
    body = {**provider.request_body(messages=_draft(), job_id="j", max_tokens=10),
            "stream_options": {"include_usage": True}}
    async with aiohttp.ClientSession() as session, session.post(
            base + "/v1/chat/completions", json=body) as resp:
        assert resp.status == 400
        error = (await resp.json())["error"]
    await provider.close()
    assert error["param"] == "stream_options"
    assert error["message"] == ("The 'stream_options' parameter is only allowed when "
                                "'stream' is enabled.")


class ScriptedStreamer:
    """A streaming provider that answers from a script of tokens, then a reply or a
    failure."""

    def __init__(self, tokens: list[str], end: ModelReply | StepFailure) -> None:
        self.tokens = tokens
        self.end = end

    def stream(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
               response_schema: dict[str, Any] | None = None) -> ModelStream:
        async def source(out: ModelStream) -> AsyncIterator[str]:
            for token in self.tokens:
                yield token
            if isinstance(self.end, StepFailure):
                raise self.end
            out.reply = self.end

        return ModelStream(source)

    async def complete(self, **_kw: Any) -> ModelReply:
        raise AssertionError("a streamed call was answered whole")

    async def close(self) -> None:
        return None


async def _budget(ledger: MemoryLedger) -> TokenBudget:
    budget = TokenBudget(ledger, "fake", "m", LIMITS, slice_seconds=0.25)
    await budget.start()
    return budget


async def test_the_budget_settles_a_stream_with_its_reported_usage() -> None:
    """A streamed call reserves like a whole one and settles with the stream's usage."""
    ledger = MemoryLedger(tokens=10_000, requests=100)
    budget = await _budget(ledger)
    inner = ScriptedStreamer(["a", "b"], ModelReply("ab", None, input_tokens=50,
                                                    output_tokens=2))
    provider = BudgetedProvider(inner, provider="openai", model="m", budget=budget,
                                counts_max_tokens=False)
    enter_scope(CallScope(priority="interactive"))
    try:
        # 400 characters: estimated 100 prompt tokens plus 20; the provider counted 52.
        stream = provider.stream(messages=[{"role": "user", "content": "x" * 400}],
                                 job_id="j", max_tokens=20)
        assert [t async for t in stream] == ["a", "b"]
        assert (await stream.final()).output_tokens == 2
        assert budget._owed["interactive"] + budget._owed["bulk"] == pytest.approx(120 - 52)
    finally:
        await provider.close()


async def test_a_broken_stream_keeps_its_reservation() -> None:
    """A stream that broke off keeps its whole estimate (the provider counted what it
    wrote); a refused one gives it back."""
    for end, kept in ((StepFailure("cut", code="stream_interrupted",
                                   failure_class=FailureClass.TRANSIENT), 0.0),
                      (StepFailure("503", code="upstream_unavailable",
                                   failure_class=FailureClass.TRANSIENT), 120.0)):
        ledger = MemoryLedger(tokens=10_000, requests=100)
        budget = await _budget(ledger)
        provider = BudgetedProvider(ScriptedStreamer(["a"], end), provider="openai",
                                    model="m", budget=budget)
        try:
            with pytest.raises(StepFailure):
                await provider.stream(messages=[{"role": "user", "content": "x" * 400}],
                                      job_id="j", max_tokens=20).final()
            assert budget._owed["interactive"] + budget._owed["bulk"] == pytest.approx(kept)
        finally:
            await provider.close()
