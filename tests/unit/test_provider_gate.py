"""The provider gate's confirmation rule (calmq.calls.gate): a 401, 403, 404 or exhausted
billing blocks a provider and model for the fleet only when a probe call, or a second job of
another tenant, confirms it; unconfirmed, it is the failed job's own. And a rate-limit pause
lifted early (`calmq provider unpause`). One process, no ledger, a hand-set clock."""

from __future__ import annotations

import asyncio

import pytest

from calmq.calls.gate import ProviderGate
from calmq.calls.wires import CallScope, enter_scope
from calmq.errors import StepFailure
from calmq.failure_codes import ProviderBlocked, failure


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Probe:
    """A probe call answering from a script: None succeeds, a StepFailure is raised."""

    def __init__(self, *answers: StepFailure | None) -> None:
        self.answers = list(answers)
        self.calls = 0

    async def __call__(self) -> object:
        self.calls += 1
        answer = self.answers.pop(0)
        if answer is not None:
            raise answer
        return "ok"


def _forbidden() -> StepFailure:
    return failure("provider_permission", "the key may not do this (403): <html>Request "
                   "blocked by the web application firewall</html>")


async def _met(gate: ProviderGate, job: str, tenant: str, met: StepFailure) -> StepFailure:
    enter_scope(CallScope(job_id=job, tenant_id=tenant))
    return await gate.failed(met)


async def test_a_refusal_the_probe_does_not_confirm_is_the_jobs_own_failure() -> None:
    """A 403 to one job while the probe call succeeds: the job gets its own permission
    failure (it dead-letters), nothing is blocked, and the next calls are admitted."""
    probe = Probe(None, None)
    gate = ProviderGate("openai:x", "m", probe=probe)
    first = await _met(gate, "job-1", "tenant-a", _forbidden())
    assert not isinstance(first, ProviderBlocked)
    assert (first.code, first.failure_class.value) == ("provider_permission", "permission")
    assert gate.blocked is None
    await gate.admit()  # other jobs' calls go through
    # A second job of another tenant with the same 403: the probe still answers, so still
    # that job's own (a firewall refusing both prompts), not a block.
    second = await _met(gate, "job-2", "tenant-b", _forbidden())
    assert not isinstance(second, ProviderBlocked)
    assert (gate.blocked, probe.calls) == (None, 2)


async def test_a_refusal_the_probe_confirms_blocks_and_names_the_job_as_met() -> None:
    """A 401 whose probe call is refused with a 401 too blocks the provider and model: the
    job gets ProviderBlocked marked met (its one uncounted hand-back), and later calls are
    refused without being sent (not met)."""
    probe = Probe(failure("provider_auth", "401 (probe)"))
    gate = ProviderGate("openai:x", "m", probe=probe)
    refused = await _met(gate, "job-1", "tenant-a", failure("provider_auth", "401"))
    assert isinstance(refused, ProviderBlocked)
    assert (refused.code, refused.met) == ("provider_auth", True)
    assert gate.blocked is not None
    assert gate.blocked.reason == "invalid_api_key"
    with pytest.raises(ProviderBlocked) as later:
        await gate.admit()
    assert later.value.met is False


async def test_a_second_job_of_another_tenant_confirms_when_there_is_no_probe() -> None:
    """With no probe to ask, the same code from the same job again, or from another job of
    the same tenant, confirms nothing; from a job of another tenant it blocks."""
    gate = ProviderGate("openai:x", "m", clock=Clock())
    for job, tenant in (("job-1", "tenant-a"), ("job-1", "tenant-a"), ("job-2", "tenant-a")):
        own = await _met(gate, job, tenant, _forbidden())
        assert not isinstance(own, ProviderBlocked), (job, tenant)
        assert gate.blocked is None
    confirmed = await _met(gate, "job-3", "tenant-b", _forbidden())
    assert isinstance(confirmed, ProviderBlocked)
    assert (confirmed.code, confirmed.met) == ("provider_permission", True)
    assert gate.blocked is not None
    assert gate.blocked.reason == "permission_denied"


async def test_a_second_job_confirms_when_the_probe_cannot_tell() -> None:
    """A probe that meets a 503 cannot tell: a second job of another tenant with the same
    code then confirms the block."""
    unavailable = failure("upstream_unavailable", "503")
    gate = ProviderGate("openai:x", "m", probe=Probe(unavailable, unavailable))
    assert not isinstance(await _met(gate, "job-1", "a", _forbidden()), ProviderBlocked)
    confirmed = await _met(gate, "job-2", "b", _forbidden())
    assert isinstance(confirmed, ProviderBlocked)


async def test_a_second_job_too_late_or_with_another_code_confirms_nothing() -> None:
    """The second job's refusal confirms only the same code, within a minute of the first."""
    clock = Clock()
    gate = ProviderGate("openai:x", "m", clock=clock)
    await _met(gate, "job-1", "a", _forbidden())
    clock.now += 61
    assert not isinstance(await _met(gate, "job-2", "b", _forbidden()), ProviderBlocked)
    other = await _met(gate, "job-3", "c", failure("model_not_found", "404"))
    assert not isinstance(other, ProviderBlocked)
    assert gate.blocked is None


async def test_refusals_that_arrive_while_the_probe_runs_share_it() -> None:
    """Ten jobs refused at once send one probe call, and all are handed back when it
    confirms the block."""
    started, release = asyncio.Event(), asyncio.Event()
    calls = 0

    async def probe() -> object:
        nonlocal calls
        calls += 1
        started.set()
        await release.wait()
        raise failure("provider_auth", "401 (probe)")

    gate = ProviderGate("openai:x", "m", probe=probe)

    async def one(n: int) -> StepFailure:
        return await _met(gate, f"job-{n}", f"tenant-{n}", failure("provider_auth", "401"))

    tasks = [asyncio.create_task(one(n)) for n in range(10)]
    await asyncio.wait_for(started.wait(), timeout=5)
    release.set()
    answers = await asyncio.gather(*tasks)
    assert calls == 1
    assert all(isinstance(a, ProviderBlocked) and a.met for a in answers)


async def test_an_unpause_notification_lifts_the_pause_at_once() -> None:
    """`calmq provider unpause` (its notification) ends a rate-limit pause: calls are
    admitted again and the budget is told."""
    clock = Clock()
    gate = ProviderGate("openai:x#key-0123456789", "m", clock=clock)
    told: list[bool] = []
    gate.on_unpaused = lambda: told.append(True)
    await gate.pause(300)
    assert gate.cooling_seconds() == 300
    waiting = asyncio.create_task(gate.admit())  # a call waiting out the pause
    await asyncio.sleep(0)  # one turn of the loop: the call reaches its wait (no timing)
    assert not waiting.done()
    gate.notified('{"event": "unpaused", "provider": "openai:x#key-0123456789", '
                  '"model": "m"}')
    assert (gate.cooling_seconds(), told) == (0, [True])
    await asyncio.wait_for(waiting, timeout=5)  # it goes now, not in 300 s
