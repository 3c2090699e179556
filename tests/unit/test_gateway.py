"""The gateway's providers against the fake provider over real HTTP, and error classes."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from aiohttp.test_utils import TestServer

from calmq.calls.wires import (
    RETRY_AFTER_MAX_SECONDS,
    AnthropicProvider,
    OpenAIProvider,
    Provider,
    classify_status,
    retry_after,
)
from calmq.calls.wires import open_provider as open_gateway_provider
from calmq.errors import FailureClass, StepFailure
from calmq.tooling.fake_provider import FakeProviderSettings, build_app

OpenProvider = Callable[..., Awaitable[Provider]]


@pytest_asyncio.fixture
async def open_provider() -> AsyncIterator[OpenProvider]:
    opened: list[tuple[TestServer, Provider]] = []

    async def make(kind: str = "openai", app: web.Application | None = None,
                   **settings: Any) -> Provider:
        server = TestServer(app or build_app(FakeProviderSettings(**settings)))
        await server.start_server()
        url = str(server.make_url("")).rstrip("/")
        cls = AnthropicProvider if kind == "anthropic" else OpenAIProvider
        provider = cls(url, "key", "fake-small")
        opened.append((server, provider))
        return provider

    yield make
    for server, provider in opened:
        await provider.close()
        await server.close()


def _messages(**step: Any) -> list[dict[str, str]]:
    return [{"role": "system", "content": "Summarize."},
            {"role": "user", "content": json.dumps({"text": "a b c d", **step})}]


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_reply_carries_content_and_usage(open_provider: OpenProvider, kind: str) -> None:
    """Both API shapes return the model's text and the input and output tokens it reported."""
    provider = await open_provider(kind)
    reply = await provider.complete(messages=_messages(), job_id="j1", max_tokens=64)
    assert json.loads(reply.content or "")["summary"] == "a b c d"
    assert reply.refusal is None
    assert reply.input_tokens > 0
    assert reply.output_tokens > 0


@pytest.mark.parametrize(("mode", "code", "failure_class"), [
    ("rate_limited", "rate_limited", FailureClass.TRANSIENT),
    ("always_fail", "upstream_unavailable", FailureClass.TRANSIENT),
    ("bad_request", "provider_bad_request", FailureClass.INPUT),
    ("unauthorized", "provider_auth", FailureClass.PERMISSION),
    ("forbidden", "provider_permission", FailureClass.PERMISSION),
    ("model_not_found", "model_not_found", FailureClass.PERMISSION),
    ("quota_exceeded", "insufficient_quota", FailureClass.PERMISSION),
    ("context_length", "context_length_exceeded", FailureClass.INPUT),
    ("too_large", "request_too_large", FailureClass.INPUT),
    ("server_error", "upstream_unavailable", FailureClass.TRANSIENT),
    ("truncated", "upstream_garbled", FailureClass.TRANSIENT),
])
@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_error_answers_get_their_failure_class(
    open_provider: OpenProvider, kind: str, mode: str, code: str, failure_class: FailureClass,
) -> None:
    """Each real failure gets its registered code and class, for either API shape: 429 and
    5xx transient, a cut-off body transient, 400 input (context length too), 401/403/404 and
    exhausted billing permission (which pause the provider, calmq.calls.budget)."""
    provider = await open_provider(kind, retry_after_seconds=3)
    with pytest.raises(StepFailure) as caught:
        await provider.complete(messages=_messages(mode=mode), job_id="j1", max_tokens=64)
    if kind == "anthropic" and mode == "always_fail":
        code = "provider_overloaded"  # Anthropic's 5xx body names overloaded_error
    assert (caught.value.code, caught.value.failure_class) == (code, failure_class)
    if mode == "rate_limited":
        assert caught.value.retry_after == 3


async def test_overloaded_is_its_own_transient_code(open_provider: OpenProvider) -> None:
    """Anthropic's 529 overloaded_error is transient, coded provider_overloaded."""
    provider = await open_provider("anthropic")
    with pytest.raises(StepFailure) as caught:
        await provider.complete(messages=_messages(mode="overloaded"), job_id="j", max_tokens=9)
    assert (caught.value.code, caught.value.failure_class) == ("provider_overloaded",
                                                               FailureClass.TRANSIENT)


def test_retry_after_ms_is_read_before_retry_after() -> None:
    """OpenAI's retry-after-ms is the precise wait; retry-after (seconds) is the fallback."""
    assert classify_status(429, "", {"retry-after-ms": "1200", "Retry-After": "2"}
                           ).retry_after == 1.2
    assert classify_status(429, "", {"Retry-After": "2"}).retry_after == 2


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_refusal_is_reported_not_returned_as_content(
    open_provider: OpenProvider, kind: str
) -> None:
    """A refusal comes back as ``refusal`` with no content, for the step to class as policy."""
    provider = await open_provider(kind)
    reply = await provider.complete(messages=_messages(mode="refusal"), job_id="j1",
                                    max_tokens=64)
    assert reply.refusal
    assert not reply.content


async def test_provider_limit_answers_429_with_retry_after(open_provider: OpenProvider) -> None:
    """Past the provider's own requests per minute, the gateway sees a transient 429."""
    provider = await open_provider(requests_per_minute=1)
    await provider.complete(messages=_messages(), job_id="j1", max_tokens=8)
    with pytest.raises(StepFailure) as caught:
        await provider.complete(messages=_messages(), job_id="j2", max_tokens=8)
    assert caught.value.code == "rate_limited"
    assert caught.value.retry_after is not None
    assert caught.value.retry_after > 0


async def test_content_filter_finish_is_a_refusal(open_provider: OpenProvider) -> None:
    """An OpenAI answer stopped by the content filter is a refusal, not an empty success."""
    async def filtered(request: web.Request) -> web.Response:
        return web.json_response({"choices": [{"message": {"role": "assistant",
                                                            "content": None},
                                               "finish_reason": "content_filter"}],
                                  "usage": {"prompt_tokens": 5, "completion_tokens": 0}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", filtered)
    provider = await open_provider(app=app)
    reply = await provider.complete(messages=_messages(), job_id="j1", max_tokens=8)
    assert reply.refusal
    assert reply.input_tokens == 5


async def test_openai_request_bounds_the_answer_with_max_completion_tokens(
    open_provider: OpenProvider,
) -> None:
    """The Chat Completions body names the limit max_completion_tokens and sends no max_tokens."""
    seen: list[dict[str, Any]] = []

    async def record(request: web.Request) -> web.Response:
        seen.append(await request.json())
        return web.json_response({"choices": [{"message": {"role": "assistant",
                                                            "content": "ok"},
                                               "finish_reason": "stop"}],
                                  "usage": {"prompt_tokens": 5, "completion_tokens": 1}})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", record)
    provider = await open_provider(app=app)
    await provider.complete(messages=_messages(), job_id="j1", max_tokens=64)
    assert seen[0]["max_completion_tokens"] == 64
    assert "max_tokens" not in seen[0]


async def test_unreachable_provider_is_transient(open_provider: OpenProvider) -> None:
    """A connection refused is a transient failure, retried later."""
    provider = OpenAIProvider("http://127.0.0.1:9", "", "m")
    try:
        with pytest.raises(StepFailure) as caught:
            await provider.complete(messages=_messages(), job_id="j1", max_tokens=8)
        assert caught.value.failure_class is FailureClass.TRANSIENT
    finally:
        await provider.close()


def test_content_policy_400_is_a_policy_failure() -> None:
    """A 400 naming the content policy is ``policy``, not ``input``."""
    body = '{"error": {"code": "content_policy_violation", "message": "no"}}'
    assert classify_status(400, body).failure_class is FailureClass.POLICY
    assert classify_status(400, '{"error": "bad field"}').failure_class is FailureClass.INPUT
    assert classify_status(503, "", {"Retry-After": "4"}).retry_after == 4


def _openai_error(message: str, kind: str, code: str | None) -> str:
    return json.dumps({"error": {"message": message, "type": kind, "param": None,
                                 "code": code}})


_ECHOED = ("Could not parse your request: 'Summarize: our insufficient_quota and "
           "billing_error pages say the credit balance is too low'")


_FREE_TEXT = [
    (400, _openai_error(_ECHOED, "invalid_request_error", None), "provider_bad_request"),
    (429, _openai_error(_ECHOED, "requests", "rate_limit_exceeded"), "rate_limited"),
    (503, _ECHOED, "upstream_unavailable"),
    (400, json.dumps({"type": "error", "error": {"type": "invalid_request_error",
                                                 "message": _ECHOED}}),
     "provider_bad_request"),
]
_STRUCTURED = [
    (429, _openai_error("You exceeded your current quota.", "insufficient_quota",
                        "insufficient_quota")),
    (429, _openai_error("You exceeded your current quota.", "requests",
                        "insufficient_quota")),
    (400, json.dumps({"type": "error", "error": {"type": "billing_error",
                                                 "message": "Check your billing."}})),
    (400, json.dumps({"code": "insufficient_quota", "message": "a batch line's error"})),
    (402, "Payment Required"),
]


def test_quota_words_count_only_in_the_structured_error_code() -> None:
    """A quota word only in an error's message (a prompt echoed back) does not classify as
    insufficient_quota, which would block the model for the whole fleet; OpenAI's
    error.code / error.type, Anthropic's error.type, a batch line's error code, or a 402
    do."""
    assert [classify_status(status, body).code for status, body, _ in _FREE_TEXT] == [
        code for _, _, code in _FREE_TEXT]
    assert {classify_status(status, body).code for status, body in _STRUCTURED} == {
        "insufficient_quota"}


@pytest.mark.parametrize("headers", [
    {"Retry-After": "inf"}, {"Retry-After": "nan"}, {"Retry-After": "1e999"},
    {"Retry-After": "-inf"}, {"retry-after-ms": "inf"}, {"retry-after-ms": "1e999"},
    {"retry-after-ms": "nan"},
])
def test_a_retry_after_that_is_not_a_finite_number_is_ignored(headers: dict[str, str]) -> None:
    """Retry-After: inf, nan or 1e999 (and the same in retry-after-ms) is treated as absent,
    not as a wait for ever."""
    assert retry_after(headers) is None
    assert classify_status(429, "", headers).retry_after is None


def test_a_non_finite_retry_after_ms_falls_back_to_retry_after() -> None:
    """retry-after-ms: inf is ignored; the retry-after beside it is the wait."""
    assert retry_after({"retry-after-ms": "inf", "Retry-After": "2"}) == 2


@pytest.mark.parametrize("headers", [
    {"Retry-After": "86400"}, {"retry-after-ms": "86400000"},
    {"Retry-After": "Fri, 31 Dec 9999 23:59:59 GMT"},
])
def test_a_huge_retry_after_is_clamped_to_the_maximum(headers: dict[str, str]) -> None:
    """A day's Retry-After (in seconds, milliseconds or as a date) is cut to the maximum: the
    default 300 s, or the one passed (provider_retry_after_max_seconds)."""
    assert retry_after(headers) == RETRY_AFTER_MAX_SECONDS == 300
    assert classify_status(429, "", headers, retry_after_max=30).retry_after == 30


async def test_the_providers_retry_after_maximum_holds_over_http() -> None:
    """A provider opened with retry_after_max (the worker passes the setting) reports a
    429's 120 s Retry-After as that maximum."""
    server = TestServer(build_app(FakeProviderSettings(retry_after_seconds=120)))
    await server.start_server()
    provider = open_gateway_provider("openai", str(server.make_url("")).rstrip("/"), "key",
                                     "fake-small", retry_after_max=7.5)
    try:
        with pytest.raises(StepFailure) as caught:
            await provider.complete(messages=_messages(mode="rate_limited"), job_id="j1",
                                    max_tokens=8)
    finally:
        await provider.close()
        await server.close()
    assert (caught.value.code, caught.value.retry_after) == ("rate_limited", 7.5)


def test_the_retry_after_maximum_is_a_setting_of_300_seconds() -> None:
    """provider_retry_after_max_seconds defaults to 300 and refuses a non-finite value."""
    from pydantic import ValidationError

    from calmq.settings import Settings

    assert Settings().provider_retry_after_max_seconds == 300
    with pytest.raises(ValidationError):
        Settings(provider_retry_after_max_seconds=float("inf"))


def _infinite_usage_app() -> web.Application:
    """A provider stand-in whose answers (whole, or streamed) count 1e999 prompt tokens."""
    async def chat(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        usage = '{"prompt_tokens": 1e999, "completion_tokens": 1, "total_tokens": 2}'
        if not body.get("stream"):
            return web.Response(content_type="application/json", text=(
                '{"id": "c", "object": "chat.completion", "created": 0, "model": "m", '
                '"choices": [{"index": 0, "finish_reason": "stop", "message": {"role": '
                '"assistant", "content": "{}"}}], "usage": ' + usage + "}"))
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b'data: {"id": "c", "object": "chat.completion.chunk", "created": 0, '
                         b'"model": "m", "choices": [{"index": 0, "delta": {"content": "{}"}, '
                         b'"finish_reason": "stop"}]}\n\n')
        await resp.write(b'data: {"id": "c", "object": "chat.completion.chunk", "created": 0, '
                         b'"model": "m", "choices": [], "usage": ' + usage.encode() + b"}\n\n")
        await resp.write(b"data: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", chat)
    return app


async def test_a_token_count_of_1e999_is_a_garbled_answer_not_a_bug(
        open_provider: OpenProvider) -> None:
    """A reply (whole or streamed) counting 1e999 tokens fails as upstream_garbled, not as
    the OverflowError int(inf) raises (a bug, dead-lettered at once)."""
    provider = await open_provider(app=_infinite_usage_app())
    with pytest.raises(StepFailure) as whole:
        await provider.complete(messages=[{"role": "user", "content": "x"}], job_id="j",
                                max_tokens=10)
    assert whole.value.code == "upstream_garbled"

    async def read_stream() -> None:
        stream = provider.stream(messages=[{"role": "user", "content": "x"}], job_id="j",
                                 max_tokens=10)
        async for _text in stream:
            pass
        await stream.final()

    with pytest.raises(StepFailure) as streamed:
        await read_stream()
    assert streamed.value.code == "upstream_garbled"
