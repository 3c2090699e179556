"""Latency distributions of the fake provider: the spec grammar and the draws' shape."""

from __future__ import annotations

import statistics
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from pydantic import ValidationError

from calmq.cli import main as cli_main
from calmq.tooling.fake_provider import FakeProviderSettings, build_app
from calmq.tooling.latency import parse_latency


def test_fixed_spec_in_either_form_and_unit() -> None:
    """fixed:value=2s, fixed:2000 and fixed:2000ms are the same 2 s, with no spread."""
    for spec in ("fixed:value=2s", "fixed:2000", "fixed:2000ms"):
        dist = parse_latency(spec)
        assert (dist.kind, dist.median, dist.p99, dist.mean) == ("fixed", 2.0, 2.0, 2.0)
        assert dist.draw(dist.sampler()) == 2.0


def test_lognormal_draws_have_the_median_and_p99_asked_for() -> None:
    """100,000 draws of lognormal:median=8s,p99=40s: median within 2 %, p99 within 5 %, and
    their mean is the mean the distribution reports (what the longcalls bench divides by)."""
    dist = parse_latency("lognormal:median=8s,p99=40s")
    rng = dist.sampler()
    draws = sorted(dist.draw(rng) for _ in range(100_000))
    assert draws[50_000] == pytest.approx(8.0, rel=0.02)
    assert draws[99_000] == pytest.approx(40.0, rel=0.05)
    assert statistics.fmean(draws) == pytest.approx(dist.mean, rel=0.02)
    assert dist.mean == pytest.approx(10.16, abs=0.01)


def test_seed_makes_draws_repeatable() -> None:
    """The same seed gives the same draws; another seed gives others."""
    a, b, c = (parse_latency(f"lognormal:median=8,p99=40,seed={s}") for s in (1, 1, 2))
    ra, rb, rc = a.sampler(), b.sampler(), c.sampler()
    first = [a.draw(ra) for _ in range(5)]
    assert first == [b.draw(rb) for _ in range(5)]
    assert first != [c.draw(rc) for _ in range(5)]


@pytest.mark.parametrize(("spec", "message"), [
    ("gamma:median=8s", "unknown latency distribution 'gamma'"),
    ("lognormal:median=8s", "takes median and p99"),
    ("lognormal:median=8s,p99=4s", "0 < median < p99"),
    ("lognormal:median=8h,p99=40s", "must be a duration"),
    ("fixed:value=2s,p99=3s", "one duration"),
    ("lognormal:median=8s,p99=40s,seed=x", "whole number"),
])
def test_bad_specs_say_what_is_expected(spec: str, message: str) -> None:
    """Every malformed spec is rejected with a message naming the accepted form."""
    with pytest.raises(ValueError, match=message):
        parse_latency(spec)
    with pytest.raises(ValidationError, match=message):
        FakeProviderSettings(latency_dist=spec)


def test_settings_reject_both_latencies() -> None:
    """latency_dist replaces latency_ms: setting both is ambiguous and rejected."""
    with pytest.raises(ValidationError, match="not both"):
        FakeProviderSettings(latency_ms=5, latency_dist="fixed:5")


def test_cli_rejects_a_bad_spec_with_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """`calmq fake-provider --latency-dist ...` exits 2 with the flag and the accepted form."""
    assert cli_main(["fake-provider", "--port", "0", "--latency-dist", "lognormal:p99=1s"]) == 2
    err = capsys.readouterr().err
    assert "error [usage]: --latency-dist: log-normal latency takes median and p99" in err


async def test_provider_answers_after_a_draw_per_call() -> None:
    """Over real HTTP, answers under lognormal:median=40ms,p99=200ms take different times,
    their median no shorter than the distribution allows."""
    app = build_app(FakeProviderSettings(latency_dist="lognormal:median=40ms,p99=200ms"))
    client: TestClient[web.Request, web.Application] = TestClient(TestServer(app))
    await client.start_server()
    try:
        took = []
        body = {"model": "m", "messages": [{"role": "user", "content": '{"text": "a b"}'}]}
        for _ in range(30):
            started = time.monotonic()
            resp = await client.post("/v1/chat/completions", json=body)
            assert resp.status == 200
            took.append(time.monotonic() - started)
    finally:
        await client.close()
    assert len({round(t, 3) for t in took}) > 20  # spread, not one fixed value
    # A lower bound only: a loaded machine adds time, it never takes any away.
    assert statistics.median(took) > 0.025
