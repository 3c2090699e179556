"""Service tiers chosen per call from the time a job has left (calmq.calls.tiers), sent to
the fake provider (which models flex's latency and capacity refusals) through the wires and
the budget wrapper, and the settings that enable them."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp import web

from calmq.calls.budgeted_provider import BudgetedProvider
from calmq.calls.tiers import Latencies, TierChooser, TierPolicy, chooser_for
from calmq.calls.wires import CallScope, enter_scope, model_clock, open_provider
from calmq.errors import ConfigError
from calmq.settings import Settings
from calmq.tooling.fake_provider import FakeProviderSettings, build_app, conformance

MODEL = "gpt-5-mini"
MESSAGES = [{"role": "user", "content": '{"text": "tiers"}'}]
FLEX = TierPolicy(frozenset({"flex"}), flex_seconds=2.0, standard_seconds=0.5, margin=1.0)


def _scope(left: float | None, priority: str = "bulk", tenant: str = "t1") -> CallScope:
    return CallScope("job", tenant, "wf", priority,
                     deadline=None if left is None else time.time() + left)


async def _fake(**settings: Any) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(build_app(FakeProviderSettings(**settings)))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    await conformance.ready()  # the SDKs' request types loaded: calls take their latency
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}"


@pytest.fixture
async def refusing() -> AsyncIterator[str]:
    """A fake whose flex tier refuses every call for capacity."""
    runner, url = await _fake(flex_refusal_rate=1.0, latency_ms=5)
    try:
        yield url
    finally:
        await runner.cleanup()


def test_the_cheapest_tier_that_meets_the_time_left() -> None:
    """Bulk with room for a flex call and a standard one after it: flex, cut off when only
    the standard tier's time is left; less room, or an interactive job: the standard."""
    chooser = TierChooser(FLEX, "openai", MODEL)
    scope = _scope(10.0)
    choice = chooser.choose(scope)
    assert choice.tier == "flex"
    assert choice.cutoff == pytest.approx((scope.deadline or 0) - 0.5)
    assert chooser.choose(_scope(None)).tier == "flex"
    assert chooser.choose(_scope(2.2)).tier is None
    assert chooser.choose(_scope(10.0, "interactive")).tier is None


def test_priority_only_where_allowed_and_the_standard_would_miss() -> None:
    """Priority is asked only for a tenant allowed it, when the standard tier's measured
    latency would miss the time left and priority's would not: never where the standard
    would do, nor where priority is no faster."""
    policy = TierPolicy(frozenset({"priority"}), frozenset({"t1"}), standard_seconds=0.5,
                        margin=1.0)
    chooser = TierChooser(policy, "openai", MODEL)
    assert chooser.choose(_scope(5.0, "interactive")).tier is None
    # Not before the standard tier has answered (tests/unit/test_tier_choice.py).
    assert chooser.choose(_scope(0.3, "interactive")).tier is None
    chooser.latencies.observe("openai", MODEL, "standard", 0.5)
    assert chooser.choose(_scope(0.3, "interactive")).tier == "priority"
    assert chooser.choose(_scope(0.3, "interactive", tenant="t2")).tier is None
    # Measured no faster than the standard tier: priority would miss too, and is not paid.
    for _ in range(5):
        chooser.latencies.observe("openai", MODEL, "priority", 0.5)
    assert chooser.choose(_scope(0.3, "interactive")).tier is None


def test_measured_latency_replaces_the_estimate() -> None:
    """Once a tier has answered, its measured latency (a high quantile of the last calls)
    decides: flex measured slow is no longer chosen for a deadline it would miss."""
    latencies = Latencies()
    chooser = TierChooser(FLEX, "openai", MODEL, latencies=latencies)
    assert chooser.choose(_scope(5.0)).tier == "flex"
    for _ in range(10):
        latencies.observe("openai", MODEL, "flex", 6.0)
    assert chooser.choose(_scope(5.0)).tier is None


def test_an_unpriced_tier_is_refused_by_the_settings() -> None:
    """A tier the configured model has no price for is a settings error naming it, not a
    call priced at 0 or at the standard price; a priced one is taken."""
    with pytest.raises(ConfigError, match="service tier 'flex' of model 'fake-small'"):
        Settings.load(environ={"CALMQ_SERVICE_TIERS": "flex"})
    with pytest.raises(ConfigError, match="flex and priority"):
        Settings.load(environ={"CALMQ_SERVICE_TIERS": "scale", "CALMQ_MODEL": MODEL})
    settings = Settings.load(environ={"CALMQ_SERVICE_TIERS": "flex,priority",
                                      "CALMQ_MODEL": MODEL})
    assert settings.service_tier_list == ["flex", "priority"]
    chooser = chooser_for(settings, "openai", MODEL)
    assert chooser is not None
    assert chooser.policy.tiers == {"flex", "priority"}
    # A step's other model without a flex price is sent at the standard tier.
    other = chooser_for(settings, "openai", "gpt-4o-mini")
    assert other is not None
    assert other.policy.tiers == {"priority"}


async def test_a_refused_flex_call_is_served_at_standard_in_the_same_call(
        refusing: str) -> None:
    """The fake refuses flex for capacity: the call is sent again at once at the standard
    tier inside the same call (one reply, no failure, nothing paused), and the move is
    recorded on the attempt's clock."""
    inner = open_provider("openai", refusing, "k", MODEL)
    provider = BudgetedProvider(inner, provider="openai", model=MODEL,
                                tiers=TierChooser(FLEX, "openai", MODEL))
    try:
        enter_scope(_scope(60.0))
        clock = model_clock()
        reply = await provider.complete(messages=MESSAGES, job_id="j", max_tokens=64)
        assert reply.service_tier == "default"
        entry = clock.tiers[0]
        assert len(clock.tiers) == 1
        assert {k: entry[k] for k in ("model", "chosen", "served", "moved")} == {
            "model": MODEL, "chosen": "flex", "served": "standard", "moved": "flex_refused"}
        assert 59 < entry["left_s"] <= 60
        assert clock.tiers[0]["moved_ms"] < 1000
    finally:
        await provider.close()


async def test_a_late_flex_call_moves_to_standard_at_its_cutoff() -> None:
    """A flex call still unanswered when only the standard tier's time is left is
    abandoned and sent at the standard tier, so the deadline is met."""
    runner, url = await _fake(flex_latency_ms=1500, latency_ms=5)
    inner = open_provider("openai", url, "k", MODEL)
    policy = TierPolicy(frozenset({"flex"}), flex_seconds=0.1, standard_seconds=0.5,
                        margin=1.0)
    provider = BudgetedProvider(inner, provider="openai", model=MODEL,
                                tiers=TierChooser(policy, "openai", MODEL))
    try:
        enter_scope(_scope(1.0))
        clock = model_clock()
        started = time.monotonic()
        reply = await provider.complete(messages=MESSAGES, job_id="j", max_tokens=64)
        assert time.monotonic() - started < 1.0
        assert reply.service_tier == "default"
        assert clock.tiers[0]["moved"] == "flex_late"
    finally:
        await provider.close()
        await runner.cleanup()


async def test_a_flex_call_that_answers_is_priced_at_flex() -> None:
    """A flex call served at flex is recorded as such and costs the flex price: half the
    standard price of the same call."""
    runner, url = await _fake(flex_latency_ms=10, latency_ms=5)
    inner = open_provider("openai", url, "k", MODEL)
    flex = BudgetedProvider(inner, provider="openai", model=MODEL,
                            tiers=TierChooser(FLEX, "openai", MODEL))
    standard = BudgetedProvider(open_provider("openai", url, "k", MODEL), provider="openai",
                                model=MODEL)
    try:
        enter_scope(_scope(60.0))
        clock = model_clock()
        await flex.complete(messages=MESSAGES, job_id="j", max_tokens=64)
        assert [{k: v for k, v in t.items() if k != "left_s"} for t in clock.tiers] == [
            {"model": MODEL, "chosen": "flex", "served": "flex"}]
        flex_cost = clock.cost_usd
        clock = model_clock()
        await standard.complete(messages=MESSAGES, job_id="j", max_tokens=64)
        assert clock.tiers == []
        assert flex_cost == pytest.approx(clock.cost_usd / 2)
    finally:
        await flex.close()
        await standard.close()
        await runner.cleanup()


def test_a_workflow_default_deadline_applies_to_a_submit_without_one() -> None:
    """A workflow's deadline_seconds is the deadline of a job submitted without one; a
    submit's own wins."""
    import uuid
    from dataclasses import replace
    from datetime import UTC, datetime

    from calmq.producers.intake import prepare
    from calmq.workflows.summarize import SUMMARIZE

    workflow = replace(SUMMARIZE, deadline_seconds=3600)
    tenant = uuid.uuid4()
    job = prepare(workflow, tenant, input={"text": "x"})
    assert job.deadline_at is not None
    assert 3590 < (job.deadline_at - datetime.now(UTC)).total_seconds() <= 3600
    own = prepare(workflow, tenant, deadline_seconds=60, input={"text": "x"})
    assert own.deadline_at is not None
    assert (own.deadline_at - datetime.now(UTC)).total_seconds() <= 60
    assert prepare(SUMMARIZE, tenant, input={"text": "x"}).deadline_at is None


def test_the_console_names_a_missed_deadline_and_each_calls_tier() -> None:
    """The console's line of an attempt's event names each call's tier (chosen, served, a
    move) and a missed deadline."""
    from calmq.producers.console.shaping import event_summary

    line = event_summary({"tiers": [{"model": MODEL, "chosen": "flex", "served": "standard",
                                     "moved": "flex_refused", "moved_ms": 40.0},
                                    {"model": MODEL, "chosen": "flex", "served": "flex"}],
                          "deadline_missed": {"deadline_at": "2026-01-01T00:00:00+00:00",
                                              "late_seconds": 1.5}})
    assert "deadline missed by 1.5 s" in line
    assert "tiers flex->standard (flex_refused), flex->flex" in line
