"""`calmq jobs rerun`'s own rules: how it paces itself through the budget, and what its
filter accepts."""

from __future__ import annotations

import pytest

from calmq.cli.reruns import _metadata, _pace, _statuses
from calmq.errors import UsageError
from calmq.settings import Settings


def _settings(**values: object) -> Settings:
    return Settings.load({k: str(v) for k, v in values.items()}, environ={})


def test_pace_is_the_bulk_share_of_the_slower_budget() -> None:
    """Without --rate the pace is a tenant's share of the bulk part of the budget at the
    matches' recorded usage a job, the slower of tokens and requests; no budget: none."""
    both = _settings(budget_tokens_per_minute=60_000, budget_requests_per_minute=600,
                     budget_interactive_share=0.2, budget_tenant_share=0.5)
    # tokens: 60,000 * 0.4 / 1,000 a job / 60 = 0.4 jobs/s; requests: 600 * 0.4 / 2 / 60 = 2
    rate, why = _pace(both, jobs=10, tokens=10_000, calls=20)
    assert rate == pytest.approx(0.4)
    assert "budget_tokens_per_minute" in why
    rate, why = _pace(_settings(budget_requests_per_minute=600, budget_interactive_share=0.2,
                                budget_tenant_share=0.5), jobs=10, tokens=10_000, calls=20)
    assert rate == pytest.approx(2.0)
    assert "budget_requests_per_minute" in why
    assert _pace(_settings(), jobs=10, tokens=10_000, calls=20)[0] is None


def test_filter_takes_only_ended_statuses_and_key_value_metadata() -> None:
    """--status is one of the ended statuses (all three by default); --metadata is
    KEY=VALUE, repeated, or the object a checkpoint saved."""
    assert _statuses(None) == ["completed", "dead_letter", "cancelled"]
    assert _statuses("completed,dead_letter") == ["completed", "dead_letter"]
    with pytest.raises(UsageError):
        _statuses("queued")
    assert _metadata(["batch=7", "src=a=b"]) == {"batch": "7", "src": "a=b"}
    assert _metadata({"batch": "7"}) == {"batch": "7"}
    assert _metadata(None) is None
    with pytest.raises(UsageError):
        _metadata(["novalue"])
