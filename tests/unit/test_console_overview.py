"""The overview's consumer-lag, review-cap and providers rendering, and the lag reader's
timeout."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime

from calmq.data.providers import ProviderState
from calmq.lag import GroupLag
from calmq.producers.console.lag import FleetLag
from calmq.producers.console.shaping import (
    held_for_review_cap,
    lag_view,
    providers_view,
    review_cap_state,
    waiting_notice,
)
from calmq.producers.console.templates import environment
from calmq.settings import Settings


def lag_section(lags: list[GroupLag] | None) -> str:
    """The overview's lag section as its template renders it."""
    return environment().get_template("_lag.html").render(lag=lag_view(lags))


def test_lag_renders_as_a_table_and_a_bar_per_topic_and_group() -> None:
    html = lag_section([GroupLag("calmq.default", "calmq.work.default.bulk", 1234, 2),
                        GroupLag("calmq.forwarder", "calmq.retry.5s", 0, 2)])
    assert 'data-testid="consumer-lag"' in html
    assert "<td>calmq.default</td><td>calmq.work.default.bulk</td><td>2</td><td>1,234</td>" in html
    assert "<td>calmq.forwarder</td><td>calmq.retry.5s</td><td>2</td><td>0</td>" in html
    assert html.count("<rect ") == 2  # one bar each
    assert "calmq.work.default.bulk (calmq.default): 1234" in html


def test_lag_unavailable_and_no_groups_say_so() -> None:
    assert "Consumer lag unavailable" in lag_section(None)
    empty = lag_section([])
    assert "no calmq consumer group has committed offsets yet" in empty
    assert "<svg" not in empty


def test_the_review_cap_state_says_when_new_jobs_wait() -> None:
    assert review_cap_state(1, 2, 0) == "within the cap"
    assert review_cap_state(2, 2, 3).startswith("past the cap (2 pending, cap 2)")
    assert "3 waiting" in review_cap_state(2, 2, 3)
    assert review_cap_state(0, None, 0) == "no cap set"
    assert "being released" in review_cap_state(0, None, 2)


def test_a_job_is_held_while_its_newest_wait_is_for_the_cap() -> None:
    waiting = {"type": "waiting", "detail": {"reason": "review_cap"}}
    resumed = {"type": "resumed", "detail": {"reason": "review_cap"}}
    queued = {"type": "queued", "detail": {}}
    assert held_for_review_cap([queued, waiting])
    assert not held_for_review_cap([queued, waiting, resumed])
    assert held_for_review_cap([queued, waiting, resumed, waiting])
    assert not held_for_review_cap([queued])


def test_a_waiting_jobs_page_says_which_turn_it_waits_for() -> None:
    """Fair share and concurrency keys each say what the job waits for; once resumed, or
    for the review cap (its own notice), there is none."""
    queued = {"type": "queued", "detail": {}}
    fair = {"type": "waiting", "detail": {"reason": "fair_share", "pool": "p",
                                          "priority": "bulk"}}
    key = {"type": "waiting", "detail": {"reason": "concurrency_key", "key": "customer-9",
                                         "limit": 2, "in_flight": 2}}
    resumed = {"type": "resumed", "detail": {"reason": "fair_share"}}
    notice = waiting_notice([queued, fair])
    assert notice is not None
    assert notice["reason"] == "fair_share"
    assert "bulk queue of pool p is contended" in notice["text"]
    keyed = waiting_notice([queued, fair, resumed, key])
    assert keyed is not None
    assert "customer-9 has 2 jobs in flight" in keyed["text"]
    assert waiting_notice([queued, fair, resumed]) is None
    assert waiting_notice([queued, {"type": "waiting", "detail": {"reason": "review_cap"}}]
                          ) is None
    assert waiting_notice([queued]) is None


def test_a_job_waiting_for_a_cooldown_or_its_keys_rate_says_so() -> None:
    queued = {"type": "queued", "detail": {}}
    cooling = {"type": "waiting", "detail": {"reason": "model_cooldown",
                                             "models": ["fb-first", "fb-second"],
                                             "seconds": 12.5}}
    rated = {"type": "waiting", "detail": {"reason": "rate_limit_key", "key": "customer-3",
                                           "limit": {"requests": 20, "per_seconds": 60},
                                           "seconds": 3.0}}
    notice = waiting_notice([queued, cooling])
    assert notice is not None
    assert "(fb-first, fb-second) is cooling down" in notice["text"]
    assert "about 12.5 s" in notice["text"]
    notice = waiting_notice([queued, rated])
    assert notice is not None
    assert "customer-3 used its rate limit (20 requests per 60 s)" in notice["text"]


def test_a_broker_that_does_not_answer_gives_unavailable_within_the_timeout() -> None:
    # A real client against a closed local port: nothing listens there.
    reader = FleetLag(ttl=60.0, timeout=0.5)
    started = time.monotonic()
    settings = Settings.load(environ={"CALMQ_KAFKA_BOOTSTRAP": "127.0.0.1:1"})
    assert asyncio.run(reader.read(settings)) is None
    assert time.monotonic() - started < 5.0


def test_blocked_and_paused_providers_and_unpriced_models_are_listed() -> None:
    """A blocked provider and model shows its reason (the provider's message to a platform
    key only); a rate-limit pause shows its time left; unpriced models are named."""
    now = datetime.now(UTC)
    states = [
        ProviderState("openai:https://api.openai.com/v1", "gpt-x", "invalid_api_key",
                      "provider_auth", "Incorrect API key provided: sk-a***", now, 0.0,
                      None, None, None),
        ProviderState("anthropic:https://api.anthropic.com", "claude-y", None, None, None,
                      None, 2.5, None, None, None),
        ProviderState("openai:https://api.openai.com/v1", "gpt-ok", None, None, None, None,
                      0.0, 1000, None, now),
    ]
    tenant = providers_view(states, [("openai", "gpt-x")], platform=False, now=now)
    assert tenant["blocked_providers"] == [
        ["openai", "gpt-x", "invalid_api_key", "0 s ago", "-"],
        ["anthropic", "claude-y", "rate limited: paused 2.5 s more", "-", "-"]]
    assert tenant["unpriced_models"] == [["openai", "gpt-x"]]
    platform = providers_view(states, [], platform=True, now=now)
    assert platform["blocked_providers"][0][4] == "Incorrect API key provided: sk-a***"
    assert platform["unpriced_models"] == []
