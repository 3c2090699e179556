"""The fake provider over real HTTP: every mode, limits, counters and admin endpoints."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import ClientSession, web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import ValidationError

from calmq.tooling.fake_provider import MODES, FakeProviderSettings, build_app, serve

# Anthropic refuses a call without its version header (as the fake does).
ANTHROPIC = {"anthropic-version": "2023-06-01"}

Client = TestClient[web.Request, web.Application]
MakeClient = Callable[..., Awaitable[Client]]

TEXT = "one two three four five six seven eight nine ten eleven twelve thirteen fourteen"
FIRST_12 = "one two three four five six seven eight nine ten eleven twelve"


class FakeClock:
    """A monotonic clock the test moves by hand, so the 60 s window needs no waiting."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest_asyncio.fixture
async def make_client() -> AsyncIterator[MakeClient]:
    clients: list[Client] = []

    async def make(clock: Callable[[], float] = time.monotonic, **settings: Any) -> Client:
        app = build_app(FakeProviderSettings(**settings), clock=clock)
        client: Client = TestClient(TestServer(app))
        await client.start_server()
        clients.append(client)
        return client

    yield make
    for client in clients:
        await client.close()


def openai_body(
    step: dict[str, Any] | str, job: str | None = "job-1", **extra: Any
) -> dict[str, Any]:
    content = step if isinstance(step, str) else json.dumps(step)
    body: dict[str, Any] = {
        "model": "gpt-fake",
        "messages": [
            {"role": "system", "content": "Summarise the text."},
            {"role": "user", "content": content},
        ],
        **extra,
    }
    if job is not None:
        body["user"] = job
    return body


def anthropic_body(step: dict[str, Any], job: str = "job-1") -> dict[str, Any]:
    return {
        "model": "claude-fake",
        "max_tokens": 256,
        "system": "Summarise the text.",
        "messages": [{"role": "user", "content": json.dumps(step)}],
        "metadata": {"user_id": job},
    }


async def chat(client: Client, step: dict[str, Any] | str, **kw: Any) -> tuple[int, Any, Any]:
    resp = await client.post("/v1/chat/completions", json=openai_body(step, **kw))
    return resp.status, await resp.json(), resp.headers


async def stats(client: Client) -> Any:
    resp = await client.get("/stats")
    return await resp.json()


async def test_success_returns_summary_json(make_client: MakeClient) -> None:
    """success answers 200 with the first 12 words and confidence 0.97 as JSON content."""
    client = await make_client()
    status, body, _ = await chat(client, {"text": TEXT, "mode": "success"})
    assert status == 200
    assert body["object"] == "chat.completion"
    assert body["model"] == "gpt-fake"
    choice = body["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["refusal"] is None
    assert json.loads(choice["message"]["content"]) == {"summary": FIRST_12, "confidence": 0.97}


async def test_usage_counts_all_messages_and_content(make_client: MakeClient) -> None:
    """usage is len(all message text)//4 for the prompt and len(content)//4 for completion."""
    client = await make_client()
    step = json.dumps({"text": TEXT})
    _, body, _ = await chat(client, step)
    content = body["choices"][0]["message"]["content"]
    prompt = (len("Summarise the text.") + len(step)) // 4
    completion = len(content) // 4
    assert {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens",
                                           "total_tokens")} == {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    }


async def test_non_json_content_is_summarised_as_text(make_client: MakeClient) -> None:
    """A user message that is not a JSON object is treated as text in success mode."""
    client = await make_client()
    status, body, _ = await chat(client, "just some prose here")
    assert status == 200
    result = json.loads(body["choices"][0]["message"]["content"])
    assert result == {"summary": "just some prose here", "confidence": 0.97}


async def test_slow_sleeps_slow_seconds(make_client: MakeClient) -> None:
    """slow waits settings.slow_seconds before answering like success."""
    client = await make_client(slow_seconds=0.05)
    started = time.monotonic()
    status, body, _ = await chat(client, {"text": TEXT, "mode": "slow"})
    assert time.monotonic() - started >= 0.05
    assert status == 200
    assert json.loads(body["choices"][0]["message"]["content"])["summary"] == FIRST_12


async def test_delay_ms_delays_the_answer(make_client: MakeClient) -> None:
    """delay_ms in the step input delays the answer by that long."""
    client = await make_client()
    started = time.monotonic()
    status, _, _ = await chat(client, {"text": TEXT, "delay_ms": 60})
    assert time.monotonic() - started >= 0.06
    assert status == 200


async def test_latency_ms_is_added_to_every_answer(make_client: MakeClient) -> None:
    """settings.latency_ms delays error answers as well as successes."""
    client = await make_client(latency_ms=40)
    for mode in ("success", "always_fail"):
        started = time.monotonic()
        await chat(client, {"text": TEXT, "mode": mode})
        assert time.monotonic() - started >= 0.04


async def test_malformed_returns_prose_not_schema(make_client: MakeClient) -> None:
    """malformed answers 200 with prose content that is not the summary JSON."""
    client = await make_client()
    status, body, _ = await chat(client, {"text": TEXT, "mode": "malformed"})
    assert status == 200
    assert body["choices"][0]["message"]["content"] == "Sorry, here is a summary without JSON"


async def test_always_fail_returns_503_openai_error(make_client: MakeClient) -> None:
    """always_fail answers 503 with the upstream_unavailable OpenAI error body, every time."""
    client = await make_client()
    for _ in range(3):
        status, body, _ = await chat(client, {"text": TEXT, "mode": "always_fail"})
        assert status == 503
        assert body["error"]["message"] == "upstream_unavailable"
        assert body["error"]["type"] == "server_error"
        assert body["error"]["code"] == "upstream_unavailable"


async def test_flaky_fails_fail_times_per_job_then_succeeds(make_client: MakeClient) -> None:
    """flaky fails the first fail_times calls of each job id, counted separately per job."""
    client = await make_client()
    step = {"text": TEXT, "mode": "flaky"}
    assert [(await chat(client, step, job="a"))[0] for _ in range(2)] == [503, 503]
    assert (await chat(client, step, job="b"))[0] == 503
    assert (await chat(client, step, job="a"))[0] == 200
    assert (await chat(client, step, job="b"))[0] == 503
    assert (await chat(client, step, job="b"))[0] == 200
    custom = {"text": TEXT, "mode": "flaky", "fail_times": 1}
    assert [(await chat(client, custom, job="c"))[0] for _ in range(2)] == [503, 200]


async def test_job_id_falls_back_to_header(make_client: MakeClient) -> None:
    """Without a user field the X-Calmq-Job-Id header identifies the job."""
    client = await make_client()
    body = openai_body({"text": TEXT, "mode": "flaky", "fail_times": 1}, job=None)
    headers = {"X-Calmq-Job-Id": "hdr-job"}
    first = await client.post("/v1/chat/completions", json=body, headers=headers)
    second = await client.post("/v1/chat/completions", json=body, headers=headers)
    assert (first.status, second.status) == (503, 200)
    assert (await stats(client))["by_job"]["hdr-job"] == {"calls": 2, "completed": 1}


async def test_rate_limited_mode_returns_429_with_retry_after(make_client: MakeClient) -> None:
    """rate_limited always answers 429 with Retry-After = retry_after_seconds."""
    client = await make_client(retry_after_seconds=2.0)
    for _ in range(2):
        status, body, headers = await chat(client, {"text": TEXT, "mode": "rate_limited"})
        assert status == 429
        assert headers["Retry-After"] == "2"
        assert body["error"]["code"] == "rate_limit_exceeded"


async def test_low_confidence_uses_configured_confidence(make_client: MakeClient) -> None:
    """low_confidence answers the success shape with confidence = settings.low_confidence."""
    client = await make_client(low_confidence=0.3)
    status, body, _ = await chat(client, {"text": TEXT, "mode": "low_confidence"})
    assert status == 200
    assert json.loads(body["choices"][0]["message"]["content"]) == {
        "summary": FIRST_12,
        "confidence": 0.3,
    }


async def test_refusal_sets_refusal_and_null_content(make_client: MakeClient) -> None:
    """refusal answers 200 with message.refusal set and content null."""
    client = await make_client()
    status, body, _ = await chat(client, {"text": TEXT, "mode": "refusal"})
    assert status == 200
    message = body["choices"][0]["message"]
    assert message["content"] is None
    assert message["refusal"] == "I can't help with that"


async def test_bad_request_returns_400(make_client: MakeClient) -> None:
    """bad_request answers 400 with an invalid_request_error."""
    client = await make_client()
    status, body, _ = await chat(client, {"text": TEXT, "mode": "bad_request"})
    assert status == 400
    assert body["error"]["type"] == "invalid_request_error"


async def test_unauthorized_returns_401(make_client: MakeClient) -> None:
    """unauthorized answers 401 with OpenAI's invalid_api_key error."""
    client = await make_client()
    status, body, _ = await chat(client, {"text": TEXT, "mode": "unauthorized"})
    assert status == 401
    assert body["error"]["code"] == "invalid_api_key"


async def test_unknown_mode_returns_clear_400(make_client: MakeClient) -> None:
    """An unknown mode answers 400 naming the mode and the valid ones."""
    client = await make_client()
    status, body, _ = await chat(client, {"text": TEXT, "mode": "explode"})
    assert status == 400
    assert body["error"]["code"] == "unknown_mode"
    assert "'explode'" in body["error"]["message"]
    assert "always_fail" in body["error"]["message"]


async def test_invalid_body_returns_400(make_client: MakeClient) -> None:
    """A body that is not JSON, or has no user message, answers 400 invalid_request_error."""
    client = await make_client()
    resp = await client.post("/v1/chat/completions", data=b"{not json")
    assert resp.status == 400
    assert (await resp.json())["error"]["type"] == "invalid_request_error"
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": "m", "messages": [{"role": "system", "content": "x"}]},
    )
    assert resp.status == 400


async def test_requests_per_minute_limit_over_sliding_window(make_client: MakeClient) -> None:
    """Past requests_per_minute the answer is 429 with Retry-After until the window slides."""
    clock = FakeClock()
    client = await make_client(clock=clock, requests_per_minute=2)
    step = {"text": TEXT}
    status, _, headers = await chat(client, step)
    assert (status, headers["x-ratelimit-remaining-requests"]) == (200, "1")
    clock.now += 10
    assert (await chat(client, step))[0] == 200

    status, body, headers = await chat(client, step)
    assert status == 429
    assert headers["Retry-After"] == "50"  # the first call leaves the window at t+60
    assert headers["x-ratelimit-remaining-requests"] == "0"
    assert body["error"]["code"] == "rate_limit_exceeded"

    clock.now += 49.5
    status, _, headers = await chat(client, step)
    assert (status, headers["Retry-After"]) == (429, "1")
    clock.now += 0.5
    assert (await chat(client, step))[0] == 200  # rejected calls consumed nothing
    assert (await chat(client, step))[0] == 429


async def test_tokens_per_minute_limit(make_client: MakeClient) -> None:
    """tokens_per_minute counts prompt + max_tokens and 429s with remaining-tokens headers."""
    clock = FakeClock()
    client = await make_client(clock=clock, tokens_per_minute=1000)
    step = {"text": TEXT}
    status, body, headers = await chat(client, step, max_tokens=400)
    assert status == 200
    cost = body["usage"]["prompt_tokens"] + 400
    assert headers["x-ratelimit-remaining-tokens"] == str(1000 - cost)
    clock.now += 30
    assert (await chat(client, step, max_tokens=400))[0] == 200

    status, body, headers = await chat(client, step, max_tokens=400)
    assert status == 429
    assert headers["Retry-After"] == "30"
    assert headers["x-ratelimit-remaining-tokens"] == str(1000 - 2 * cost)
    assert body["error"]["type"] == "tokens"
    # A small call still fits in what is left: rejected calls consumed nothing.
    assert (await chat(client, step, max_tokens=1))[0] == 200


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
async def test_either_token_limit_field_bounds_the_call(make_client: MakeClient,
                                                        field: str) -> None:
    """max_completion_tokens (OpenAI's current name) counts like max_tokens; 0 is a 400."""
    client = await make_client(tokens_per_minute=1000)
    status, body, headers = await chat(client, {"text": TEXT}, **{field: 400})
    assert status == 200
    cost = body["usage"]["prompt_tokens"] + 400
    assert headers["x-ratelimit-remaining-tokens"] == str(1000 - cost)
    status, body, _ = await chat(client, {"text": TEXT}, **{field: 0})
    assert status == 400
    assert body["error"]["code"] == "invalid_max_tokens"


async def test_request_larger_than_token_limit_is_429(make_client: MakeClient) -> None:
    """A single call above tokens_per_minute gets 429 'Request too large' without consuming."""
    client = await make_client(tokens_per_minute=100)
    status, body, headers = await chat(client, {"text": TEXT}, max_tokens=500)
    assert status == 429
    assert "too large" in body["error"]["message"]
    assert int(headers["Retry-After"]) >= 1
    assert (await chat(client, {"text": TEXT}, max_tokens=10))[0] == 200


async def test_stats_counts_calls_statuses_and_completions(make_client: MakeClient) -> None:
    """/stats reports total calls, per-status counts and per-job calls and completions."""
    client = await make_client()
    await chat(client, {"text": TEXT}, job="ok")
    await chat(client, {"text": TEXT, "mode": "malformed"}, job="bad")
    await chat(client, {"text": TEXT, "mode": "rate_limited"}, job="bad")
    await chat(client, {"text": TEXT, "mode": "refusal"}, job="bad")
    await chat(client, {"text": TEXT, "mode": "low_confidence"}, job="ok")
    data = await stats(client)
    assert data["calls"] == 5
    assert data["status_counts"] == {"200": 4, "429": 1}
    assert data["by_job"] == {
        "ok": {"calls": 2, "completed": 2},
        "bad": {"calls": 3, "completed": 0},
    }


async def test_admin_reset_clears_counters_and_windows(make_client: MakeClient) -> None:
    """/admin/reset zeroes counters, flaky attempts and the rate-limit window."""
    client = await make_client(requests_per_minute=1)
    assert (await chat(client, {"text": TEXT, "mode": "flaky", "fail_times": 1}))[0] == 503
    assert (await chat(client, {"text": TEXT}))[0] == 429
    resp = await client.post("/admin/reset")
    assert resp.status == 200
    assert await stats(client) == {
        "calls": 0,
        "in_flight": 0,
        "in_flight_max": 0,
        "status_counts": {},
        "by_job": {},
        "mode_override": None,
        "refused": 0,
        "refusals": [],
        "by_tier": {},
        "flex_refused": 0,
        "cached_input_tokens": 0,
        "cache_creation_input_tokens": 0,
        "billed": {},
    }
    assert (await chat(client, {"text": TEXT, "mode": "flaky", "fail_times": 1}))[0] == 503


async def test_stats_count_the_calls_open_at_once(make_client: MakeClient) -> None:
    """in_flight_max: the most model calls open together (what a fleet's slots let through,
    from the provider's side); in_flight: those open now."""
    client = await make_client(latency_ms=300)
    answers = await asyncio.gather(*(chat(client, {"text": TEXT}) for _ in range(3)))
    assert [a[0] for a in answers] == [200, 200, 200]
    got = await stats(client)
    assert (got["in_flight"], got["in_flight_max"]) == (0, 3)
    await chat(client, {"text": TEXT})  # one at a time adds nothing to the most
    assert (await stats(client))["in_flight_max"] == 3


async def test_admin_mode_overrides_every_job(make_client: MakeClient) -> None:
    """/admin/mode replaces every job's mode until set back to null; bad modes are 400."""
    client = await make_client()
    resp = await client.post("/admin/mode", json={"mode": "always_fail"})
    assert (await resp.json()) == {"mode_override": "always_fail"}
    assert (await chat(client, {"text": TEXT, "mode": "success"}))[0] == 503
    await client.post("/admin/mode", json={"mode": None})
    assert (await chat(client, {"text": TEXT, "mode": "success"}))[0] == 200
    resp = await client.post("/admin/mode", json={"mode": "nope"})
    assert resp.status == 400
    assert (await client.post("/admin/mode", json={})).status == 400


async def test_admin_outage_fails_every_call_in_turn_until_it_ends(
        make_client: MakeClient) -> None:
    """/admin/outage answers 500 and 429 (with Retry-After) in turn for every job, whatever
    its mode, until its time is up; seconds 0 ends it; a bad body is 400."""
    client = await make_client(retry_after_seconds=2)
    resp = await client.post("/admin/outage", json={"seconds": 600, "statuses": [500, 429]})
    assert resp.status == 200
    first = await chat(client, {"text": TEXT, "mode": "success"})
    second = await chat(client, {"text": TEXT, "mode": "low_confidence"})
    assert (first[0], second[0]) == (500, 429)
    assert second[2]["Retry-After"] == "2"
    assert (await client.post("/admin/outage", json={"seconds": 0})).status == 200
    assert (await chat(client, {"text": TEXT, "mode": "success"}))[0] == 200
    for bad in ({}, {"seconds": -1}, {"seconds": 5, "statuses": [200]},
                {"seconds": True}, {"seconds": 5, "statuses": []}):
        assert (await client.post("/admin/outage", json=bad)).status == 400


async def test_mode_override_setting_applies_from_start(make_client: MakeClient) -> None:
    """settings.mode_override replaces the mode asked for in the step input."""
    client = await make_client(mode_override="malformed")
    _, body, _ = await chat(client, {"text": TEXT, "mode": "success"})
    assert body["choices"][0]["message"]["content"] == "Sorry, here is a summary without JSON"


async def test_healthz(make_client: MakeClient) -> None:
    """/healthz answers 200 {"ok": true}."""
    client = await make_client()
    resp = await client.get("/healthz")
    assert (resp.status, await resp.json()) == (200, {"ok": True})


async def test_anthropic_success_shape(make_client: MakeClient) -> None:
    """/v1/messages answers in the Anthropic shape with input/output token usage."""
    client = await make_client()
    body = anthropic_body({"text": TEXT})
    resp = await client.post(
        "/v1/messages", headers=ANTHROPIC, json=body)
    assert resp.status == 200
    data = await resp.json()
    assert data["type"] == "message"
    assert data["stop_reason"] == "end_turn"
    text = data["content"][0]["text"]
    assert data["content"][0]["type"] == "text"
    assert json.loads(text) == {"summary": FIRST_12, "confidence": 0.97}
    prompt_chars = len("Summarise the text.") + len(body["messages"][0]["content"])
    assert (data["usage"]["input_tokens"], data["usage"]["output_tokens"]) == (
        prompt_chars // 4, len(text) // 4)
    assert (await stats(client))["by_job"]["job-1"] == {"calls": 1, "completed": 1}


async def test_anthropic_errors_and_flaky_per_job(make_client: MakeClient) -> None:
    """/v1/messages uses the Anthropic error shape and counts flaky per metadata.user_id."""
    client = await make_client()
    resp = await client.post(
        "/v1/messages", headers=ANTHROPIC, json=anthropic_body({"mode": "always_fail"}))
    assert resp.status == 503
    data = await resp.json()
    assert {k: data[k] for k in ("type", "error")} == {
        "type": "error",
        "error": {"type": "overloaded_error", "message": "upstream_unavailable"},
    }
    step = {"text": TEXT, "mode": "flaky", "fail_times": 1}
    first = await client.post(
        "/v1/messages", headers=ANTHROPIC, json=anthropic_body(step, job="x"))
    second = await client.post(
        "/v1/messages", headers=ANTHROPIC, json=anthropic_body(step, job="x"))
    assert (first.status, second.status) == (503, 200)
    resp = await client.post(
        "/v1/messages", headers=ANTHROPIC, json=anthropic_body({"mode": "refusal"}))
    assert (await resp.json())["stop_reason"] == "refusal"
    resp = await client.post(
        "/v1/messages", headers=ANTHROPIC, json=anthropic_body({"mode": "unauthorized"}))
    assert resp.status == 401
    assert (await resp.json())["error"]["type"] == "authentication_error"


async def test_every_mode_has_a_defined_answer(make_client: MakeClient) -> None:
    """Every listed mode answers with its own status, never a 500 or an unknown-mode 400."""
    client = await make_client(slow_seconds=0)
    expected = {
        "success": 200,
        "slow": 200,
        "malformed": 200,
        "always_fail": 503,
        "flaky": 503,
        "rate_limited": 429,
        "low_confidence": 200,
        "refusal": 200,
        "bad_request": 400,
        "invalid_line": 400,  # online; in a batch it fails the batch's validation
        "unauthorized": 401,
        "quota_exceeded": 429,
        "context_length": 400,
        "forbidden": 403,
        "model_not_found": 404,
        "too_large": 413,
        "server_error": 500,
        "overloaded": 503,  # 529 in the Anthropic shape
        # break a streamed answer half way; a call that does not stream is answered whole
        "stream_break": 200,
        "stream_error": 200,
    }
    # timeout never answers and truncated cuts its body off: tested on their own
    assert set(expected) | {"timeout", "truncated"} == MODES
    for mode, status in expected.items():
        assert (await chat(client, {"text": TEXT, "mode": mode}, job=mode))[0] == status


def test_settings_reject_unknown_fields_and_modes() -> None:
    """FakeProviderSettings forbids extra fields and unknown mode_override values."""
    with pytest.raises(ValidationError):
        FakeProviderSettings(rpm=5)  # type: ignore[call-arg]
    with pytest.raises(ValidationError):
        FakeProviderSettings(mode_override="explode")


async def test_serve_prints_ready_line_and_answers(capsys: pytest.CaptureFixture[str]) -> None:
    """serve() prints its listening line, reports the bound port and runs until cancelled."""
    loop = asyncio.get_running_loop()
    ready: asyncio.Future[str] = loop.create_future()
    task = asyncio.create_task(serve(FakeProviderSettings(port=0), on_ready=ready.set_result))
    try:
        url = await asyncio.wait_for(ready, timeout=5)
        assert f"fake-provider listening on {url}\n" in capsys.readouterr().out
        assert url.startswith("http://127.0.0.1:")
        assert not url.endswith(":0")
        async with ClientSession() as session, session.get(f"{url}/healthz") as resp:
            assert resp.status == 200
    finally:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task


def test_slow_outlasts_the_summarize_step_timeout_on_the_defaults() -> None:
    """By default slow sleeps past the timeout summarize runs with on the dev stack."""
    from calmq.settings import Settings
    from calmq.workflows import builtin_workflows

    step = builtin_workflows()["summarize"].steps[0]
    timeout = Settings().step_timeout_seconds or step.timeout_seconds
    assert FakeProviderSettings().slow_seconds > timeout


def test_the_command_refuses_to_start_without_the_sdks_and_names_the_extra() -> None:
    """Where the official SDKs are not installed (a plain `pip install calmq`), `calmq
    fake-provider` exits 2 at once with fake_provider_sdks_missing and the extra to install,
    instead of serving 500s that read as an outage."""
    import subprocess
    import sys

    hide_sdks = ("import sys; sys.modules['openai'] = None; sys.modules['anthropic'] = None; "
                 "from calmq.cli import main; sys.exit(main(['fake-provider', '--port', '0']))")
    done = subprocess.run([sys.executable, "-c", hide_sdks], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode != 0
    assert "[fake_provider_sdks_missing]" in done.stderr
    assert "pip install 'calmq[fake]'" in done.stderr
    assert "Traceback" not in done.stderr


# --- service tiers and prompt caching (tiers.py) ------------------------------------------

PREFIX = "stable prefix " * 572  # 8,008 characters: 2,002 tokens as the fake counts them


async def test_the_answer_names_the_tier_that_served_it(make_client: MakeClient) -> None:
    """service_tier in the answer is the tier that served the call: default without one (as
    before) and for auto, priority for fast (as OpenAI answers), else the tier asked for;
    /stats counts the answered calls per served tier."""
    client = await make_client()
    served = []
    for tier in (None, "auto", "default", "flex", "scale", "priority", "fast"):
        extra = {} if tier is None else {"service_tier": tier}
        status, body, _ = await chat(client, {"text": TEXT}, **extra)
        assert status == 200
        served.append(body["service_tier"])
    assert served == ["default", "default", "default", "flex", "scale", "priority", "priority"]
    got = await stats(client)
    assert got["by_tier"] == {"default": 3, "flex": 1, "scale": 1, "priority": 2}
    assert (got["flex_refused"], got["cached_input_tokens"]) == (0, 0)


async def test_flex_answers_at_its_own_latency(make_client: MakeClient) -> None:
    """A flex call takes flex_latency_ms; without the setting, four times the standard."""
    client = await make_client(flex_latency_ms=300)
    started = time.monotonic()
    assert (await chat(client, {"text": TEXT}, service_tier="flex"))[0] == 200
    assert time.monotonic() - started >= 0.3
    client = await make_client(latency_ms=50)
    started = time.monotonic()
    assert (await chat(client, {"text": TEXT}, service_tier="flex"))[0] == 200
    assert time.monotonic() - started >= 0.2


async def test_flex_refuses_its_share_for_capacity(make_client: MakeClient) -> None:
    """flex_refusal_rate 1.0: every flex call is OpenAI's 429 Resource Unavailable, while the
    default tier answers; at 0.5 exactly every second flex call is refused."""
    client = await make_client(flex_refusal_rate=1.0)
    status, body, _ = await chat(client, {"text": TEXT}, service_tier="flex")
    assert status == 429
    assert body == {"error": {
        "message": "Resource unavailable: flex processing has no capacity for this request "
                   "now. Retry later, or send it with service_tier 'default'.",
        "type": "server_error", "param": None, "code": "resource_unavailable"}}
    assert (await chat(client, {"text": TEXT}, service_tier="default"))[0] == 200
    got = await stats(client)
    assert (got["flex_refused"], got["by_tier"], got["status_counts"]) == (
        1, {"default": 1}, {"429": 1, "200": 1})
    client = await make_client(flex_refusal_rate=0.5)
    statuses = [(await chat(client, {"text": TEXT}, service_tier="flex"))[0] for _ in range(4)]
    assert sorted(statuses) == [200, 200, 429, 429]


async def _cached(client: Client, text: str, **extra: Any) -> int:
    body = openai_body({"text": text}, **extra)
    body["messages"][0]["content"] = PREFIX
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    return int((await resp.json())["usage"]["prompt_tokens_details"]["cached_tokens"])


async def test_openai_reports_a_repeated_prefix_as_cached(make_client: MakeClient) -> None:
    """A 2,002-token prefix sent again with the same prompt_cache_key is cached up to its
    last 128-token step from 1,024 (1,920 tokens); another key, or no key, caches nothing
    (requests without caching fields answer as before); the automatic setting caches all."""
    client = await make_client()
    assert await _cached(client, "first", prompt_cache_key="wf-1") == 0
    assert await _cached(client, "second", prompt_cache_key="wf-1") == 1920
    assert await _cached(client, "third", prompt_cache_key="wf-2") == 0
    assert [await _cached(client, "plain") for _ in range(2)] == [0, 0]
    got = await stats(client)
    assert (got["cached_input_tokens"], got["cache_creation_input_tokens"]) == (1920, 0)
    client = await make_client(openai_automatic_cache=True)
    assert [await _cached(client, "plain") for _ in range(2)] == [0, 1920]


async def test_a_failed_or_refused_call_puts_nothing_in_the_cache(
        make_client: MakeClient) -> None:
    """A call that fails (flaky's 503) or is refused for capacity (flex) is not billed and
    caches nothing: the flaky job's retry is the first to find its prefix uncached, and only
    the call after it reads it."""
    client = await make_client(flex_refusal_rate=1.0)
    flaky = openai_body({"text": "retried", "mode": "flaky", "fail_times": 1}, job="job-f",
                        prompt_cache_key="wf-f")
    flaky["messages"][0]["content"] = PREFIX
    assert (await client.post("/v1/chat/completions", json=flaky)).status >= 500
    refused = openai_body({"text": "flex"}, prompt_cache_key="wf-f", service_tier="flex")
    refused["messages"][0]["content"] = PREFIX
    assert (await client.post("/v1/chat/completions", json=refused)).status == 429
    retry = await client.post("/v1/chat/completions", json=flaky)
    assert retry.status == 200
    assert (await retry.json())["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert await _cached(client, "after", prompt_cache_key="wf-f") == 1920
    assert (await stats(client))["cached_input_tokens"] == 1920


async def test_anthropic_caches_only_blocks_marked_cache_control(
        make_client: MakeClient) -> None:
    """Anthropic: a system block marked cache_control is written to the cache on the first
    call (cache_creation_input_tokens) and read on the next (cache_read_input_tokens), and
    input_tokens counts only the rest; the same prompt unmarked is never cached."""
    client = await make_client()

    async def usage(marked: bool, text: str) -> list[int]:
        body = anthropic_body({"text": text})
        block: dict[str, Any] = {"type": "text", "text": PREFIX}
        if marked:
            block["cache_control"] = {"type": "ephemeral"}
        body["system"] = [block]
        resp = await client.post("/v1/messages", headers=ANTHROPIC, json=body)
        assert resp.status == 200
        got = (await resp.json())["usage"]
        return [got[k] for k in ("input_tokens", "cache_creation_input_tokens",
                                 "cache_read_input_tokens")]

    def prompt(text: str) -> int:
        return (len(PREFIX) + len(json.dumps({"text": text}))) // 4

    assert await usage(False, "a") == [prompt("a"), 0, 0]
    assert await usage(False, "b") == [prompt("b"), 0, 0]
    assert await usage(True, "a") == [prompt("a") - 2002, 2002, 0]
    assert await usage(True, "b") == [prompt("b") - 2002, 0, 2002]
    got = await stats(client)
    assert (got["cached_input_tokens"], got["cache_creation_input_tokens"]) == (2002, 2002)
    assert got["by_tier"] == {"standard": 4}
