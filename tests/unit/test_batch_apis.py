"""The batch lane's pieces without Kafka or PostgreSQL: the lane rule, the batch price, the
custom_id, the batch topic, and calmq's batch clients against the fake provider's batch APIs
(a real HTTP server on a free port), in the OpenAI and the Anthropic shape."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from datetime import UTC, datetime
from typing import Any

import pytest
from aiohttp import web

from calmq import topics
from calmq.calls.batch_apis import (
    BatchClient,
    BatchRefused,
    BatchResult,
    BatchView,
    custom_id,
    open_batch_client,
    parse_custom_id,
)
from calmq.calls.pricing import DEFAULT_PRICES, ModelPrice, batch_cost_usd, cost_usd
from calmq.errors import ContractError, FailureClass
from calmq.lanes import check_lane, choose_lane
from calmq.tooling.fake_provider import FakeProviderSettings, build_app


@pytest.mark.parametrize(("lane", "priority", "deadline", "code"), [
    ("batch", "bulk", 3600, "deadline_too_short_for_batch"),
    ("batch", "bulk", 24 * 3600 + 3599, "deadline_too_short_for_batch"),
    ("batch", "interactive", None, "batch_lane_needs_bulk"),
    ("express", "bulk", None, "invalid_lane"),
])
def test_the_lane_rule_refuses_with_a_stable_code(lane: str, priority: str,
                                                  deadline: int | None, code: str) -> None:
    with pytest.raises(ContractError) as err:
        check_lane(lane, priority, deadline)
    assert err.value.code == code
    assert err.value.status == 422


def test_the_lane_rule_accepts_what_the_lane_can_serve() -> None:
    check_lane("batch", "bulk", None)
    check_lane("batch", "bulk", 25 * 3600)
    check_lane("online", "interactive", 5)
    check_lane("batch", "bulk", 120, window_seconds=60, margin_seconds=60)


def test_a_workflow_can_make_the_batch_lane_the_default_for_its_bulk_jobs() -> None:
    """Asked for: checked (refused with its code). Not asked for: the workflow's bulk lane
    when the job fits it, else online; a default never refuses a job."""
    assert choose_lane(None, "bulk", None, bulk_lane="batch") == "batch"
    assert choose_lane(None, "interactive", None, bulk_lane="batch") == "online"
    assert choose_lane(None, "bulk", 3600, bulk_lane="batch") == "online"
    assert choose_lane(None, "bulk", None) == "online"
    assert choose_lane("online", "bulk", None, bulk_lane="batch") == "online"
    with pytest.raises(ContractError) as err:
        choose_lane("batch", "bulk", 60, bulk_lane="batch")
    assert err.value.code == "deadline_too_short_for_batch"


def test_the_batch_price_is_half_the_online_price_unless_the_table_says() -> None:
    online = cost_usd(DEFAULT_PRICES, "openai", "fake-small", 1000, 500)
    assert batch_cost_usd(DEFAULT_PRICES, "openai", "fake-small", 1000, 500) == \
        pytest.approx(online / 2)
    prices = {"m": ModelPrice(input=1.0, output=2.0, batch_input=0.25, batch_output=1.5)}
    assert batch_cost_usd(prices, "openai", "m", 1_000_000, 1_000_000) == pytest.approx(1.75)
    assert batch_cost_usd(prices, "openai", "unpriced", 10, 10) == 0.0


def test_custom_id_names_the_job_and_its_attempt_within_anthropics_alphabet() -> None:
    job = "0b6f1c9e-3c4a-4f6e-9a55-1d2e3f4a5b6c"
    value = custom_id(job, 12)
    assert parse_custom_id(value) == (job, 12)
    assert len(value) <= 64
    assert value.replace("-", "").replace("_", "").isalnum()


def test_a_batch_lane_job_goes_to_its_pools_batch_topic() -> None:
    assert topics.work_route("ocr", "bulk", "batch") == "ocr.batch"
    assert topics.work_route("ocr", "bulk") == "ocr.bulk"
    assert "calmq.ocr.batch" in topics.all_topics(["ocr"], ["5s"])


@pytest.fixture
async def fake() -> AsyncIterator[str]:
    runner = web.AppRunner(build_app(FakeProviderSettings(batch_completion_seconds=0.2)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _admin(client: BatchClient, **body: Any) -> dict[str, Any]:
    async with client.session().post(client.base_url + "/admin/batches", json=body) as resp:
        result: dict[str, Any] = await resp.json()
        return result


async def _ended(client: BatchClient, provider_id: str) -> BatchView:
    for _ in range(200):
        view = await client.view(provider_id)
        if view.ended:
            return view
        await asyncio.sleep(0.05)
    raise AssertionError(f"batch {provider_id} did not end")


def _lines(client: BatchClient, modes: list[dict[str, Any]]) -> list[bytes]:
    out = []
    for n, data in enumerate(modes):
        body = client.request_body(
            messages=[{"role": "system", "content": "Summarize."},
                      {"role": "user", "content": json.dumps({"text": f"t{n}", **data})}],
            job_id=f"job-{n}", max_tokens=64)
        out.append(client.line(custom_id(f"job-{n}", 1), body))
    return out


async def _results(client: BatchClient, view: BatchView) -> dict[str, BatchResult]:
    return {r.custom_id: r async for r in client.results(view)}


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_a_batch_answers_each_request_as_the_online_call_would(
        fake: str, kind: str) -> None:
    client = open_batch_client(kind, fake, "key", "fake-small")
    try:
        modes = [{"mode": "success"}, {"mode": "always_fail"}, {"mode": "malformed"},
                 {"mode": "bad_request"}, {"mode": "low_confidence"}]
        created = await client.create(_lines(client, modes), "k1")
        assert not created.ended
        view = await _ended(client, created.provider_id)
        assert view.outcome == "completed"
        results = await _results(client, view)
        assert set(results) == {custom_id(f"job-{n}", 1) for n in range(len(modes))}
        ok = results[custom_id("job-0", 1)]
        assert ok.reply is not None
        assert json.loads(ok.reply.content or "")["summary"]
        assert ok.reply.input_tokens > 0
        failed = results[custom_id("job-1", 1)].failure
        assert failed is not None
        # Anthropic's result names only the error type: overloaded_error is its 529.
        assert failed.code == ("provider_overloaded" if kind == "anthropic"
                               else "upstream_unavailable")
        assert failed.failure_class == FailureClass.TRANSIENT
        malformed = results[custom_id("job-2", 1)].reply
        assert malformed is not None
        assert not (malformed.content or "").startswith("{")
        bad = results[custom_id("job-3", 1)].failure
        assert bad is not None
        assert bad.failure_class == FailureClass.INPUT
        low = results[custom_id("job-4", 1)].reply
        assert low is not None
        assert json.loads(low.content or "")["confidence"] < 0.5
    finally:
        await client.close()


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_an_expired_batch_runs_no_request_and_says_so_per_request(
        fake: str, kind: str) -> None:
    client = open_batch_client(kind, fake, "key", "fake-small")
    try:
        await _admin(client, expire_next=1)
        created = await client.create(_lines(client, [{"mode": "success"}] * 3), "k2")
        view = await _ended(client, created.provider_id)
        assert view.outcome == "expired"
        results = await _results(client, view)
        assert len(results) == 3
        assert {r.failure.code for r in results.values() if r.failure} == {"batch_expired"}
        assert all(r.failure.retryable for r in results.values() if r.failure)
    finally:
        await client.close()


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_a_cancelled_batch_ends_cancelled(fake: str, kind: str) -> None:
    client = open_batch_client(kind, fake, "key", "fake-small")
    try:
        await _admin(client, completion_seconds=30)
        created = await client.create(_lines(client, [{"mode": "success"}] * 2), "k3")
        await client.cancel(created.provider_id)
        view = await _ended(client, created.provider_id)
        assert view.outcome == "cancelled"
        results = await _results(client, view)
        assert {r.failure.code for r in results.values() if r.failure} == {"batch_cancelled"}
    finally:
        await client.close()


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_a_batch_created_but_not_recorded_is_found_again(fake: str, kind: str) -> None:
    client = open_batch_client(kind, fake, "key", "fake-small")
    try:
        since = datetime.now(UTC)
        await client.create(_lines(client, [{"mode": "success"}] * 2), "other")
        created = await client.create(_lines(client, [{"mode": "success"}] * 3), "mine")
        others = set() if kind == "openai" else {"unrelated"}
        assert await client.find("mine", since, 3, others) == created.provider_id
        assert await client.find("nobody", since, 7, {created.provider_id}) is None
    finally:
        await client.close()


async def test_a_results_file_with_a_bad_line_and_a_50_mb_line_fails_only_those_requests(
        fake: str) -> None:
    """Of 300 results, one line cut off mid-JSON and one of 50 MB: each fails only the
    request it names (unreadable: retried; too large: skipped unread, not retried); every
    other request is answered, the ones after them included."""
    client = open_batch_client("openai", fake, "key", "fake-small")
    try:
        async with client.session().post(fake + "/admin/batches/synthetic", json={
                "lines": 300, "pad": 500, "corrupt": True,
                "huge_line_bytes": 50 * 1024 * 1024}) as resp:
            made = await resp.json()
        assert made["bytes"] > 50 * 1024 * 1024
        results = await _results(client, await client.view(made["id"]))
        assert len(results) == 300
        failed = {cid: r.failure for cid, r in results.items() if r.failure}
        assert {cid: f.code for cid, f in failed.items()} == {
            "synthetic-0_1": "batch_result_unreadable", "synthetic-1_1": "batch_result_too_large"}
        assert failed["synthetic-0_1"].retryable
        assert failed["synthetic-1_1"].failure_class == FailureClass.INPUT
        assert all(r.reply is not None for cid, r in results.items() if cid not in failed)
    finally:
        await client.close()


async def test_a_batch_failed_as_a_whole_is_not_expired_and_names_its_line(fake: str) -> None:
    """OpenAI fails a batch whose input file has a line its validation refuses: the view
    says failed (not expired), with the line, and the line's custom_id is read back from
    the input file. Anthropic refuses such a create, naming the request's index."""
    openai = open_batch_client("openai", fake, "key", "fake-small")
    anthropic = open_batch_client("anthropic", fake, "key", "fake-small")
    try:
        modes = [{"mode": "success"}, {"mode": "invalid_line"}, {"mode": "success"}]
        view = await openai.create(_lines(openai, modes), "k-failed")
        assert (view.ended, view.outcome) == (True, "failed")
        assert [e.line for e in view.errors] == [2]
        # A later look (the poller's) says the same as the create's answer.
        again = await openai.view(view.provider_id)
        assert (again.outcome, again.errors, again.input_file) == (
            "failed", view.errors, view.input_file)
        assert await openai.input_custom_ids(again, {2}) == {2: custom_id("job-1", 1)}
        with pytest.raises(BatchRefused) as refused:
            await anthropic.create(_lines(anthropic, modes), "k-refused")
        assert refused.value.failure.failure_class == FailureClass.INPUT
        assert "requests.1." in refused.value.failure.message
    finally:
        await openai.close()
        await anthropic.close()


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
async def test_an_ended_batch_is_deleted_at_the_provider(fake: str, kind: str) -> None:
    """Deleting an ended batch leaves the provider nothing of it: OpenAI's input, output and
    error files (DELETE /v1/files/{id}), Anthropic's batch and results (DELETE
    /v1/messages/batches/{id}, refused while it runs); a second delete is no error."""
    client = open_batch_client(kind, fake, "key", "fake-small")
    try:
        await _admin(client, completion_seconds=30)
        running = await client.create(_lines(client, [{"mode": "success"}]), "k-running")
        if kind == "anthropic":
            with pytest.raises(BatchRefused):
                await client.delete(running)
        await client.cancel(running.provider_id)
        await _admin(client, completion_seconds=0.2)
        created = await client.create(_lines(client, [{"mode": "success"},
                                                      {"mode": "always_fail"}]), "k-delete")
        view = await _ended(client, created.provider_id)
        held = await _admin(client)
        if kind == "openai":
            files = {view.input_file, *view.results}
            assert len(files) == 3
            assert files <= set(held["files"])
        await client.delete(view)
        await client.delete(view)
        left = await _admin(client)
        if kind == "openai":
            assert not files & set(left["files"])
        else:
            assert view.provider_id not in left["batch_ids"]
            with pytest.raises(BatchRefused) as gone:
                await client.view(view.provider_id)
            assert gone.value.missing
    finally:
        await client.close()


@pytest.mark.parametrize("kind", ["openai", "anthropic"])
@pytest.mark.parametrize(("line", "named"), [
    (b'{"custom_id": "job-7_1", "response": "not an object"', "job-7_1"),  # cut off
    (b'{"custom_id": "job-7_1", "response": "a string", "result": 3}', "job-7_1"),
    (b'[1, 2, 3]', ""),
    (b'{"id": "x", "error": null}', ""),
    (b'\xff\xfe not utf-8', ""),
])
def test_a_results_line_that_is_not_a_result_fails_only_the_request_it_names(
        kind: str, line: bytes, named: str) -> None:
    """A line that is not JSON, or JSON in another shape, is read as a failure of the
    request it names (batch_result_unreadable, retried), never an exception that stops the
    file; a line naming no request has custom_id "" (the poller skips it)."""
    client = open_batch_client(kind, "http://127.0.0.1:9", "key", "fake-small")
    result = client.read_line(line)
    assert result.custom_id == named
    assert result.reply is None
    assert result.failure is not None
    assert (result.failure.code, result.failure.retryable) == ("batch_result_unreadable", True)
