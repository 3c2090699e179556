"""The fleet's view of each provider and model: blocked (and why), paused (until when),
and the limits the provider states.

Failures are read the way the providers mean them (calmq.failure_codes):

- A bad key, a missing permission, a model the account cannot use, exhausted billing
  (``pause`` codes) block the provider and model fleet-wide, once confirmed: one job's 401,
  403 or 404 may be about that job alone (a web application firewall in front of the
  provider answers 403 to a prompt that merely looks like SQL injection). The answer is
  confirmed by a probe call made at once (one tiny request, shared by the failures that
  arrive while it runs) that is refused with such a code too, or, when there is no probe or
  it cannot tell (a timeout, a 5xx), by the same code from a second job of another tenant
  within ``_SECOND_JOB_SECONDS``. Unconfirmed, the failure is the job's own: it fails as its
  class says (dead letter, ``permission``) and the other jobs carry on. A probe that
  succeeds clears the suspicion.
- Confirmed, the block is written to PostgreSQL (``provider_states``) and announced on
  ``LISTEN calmq_providers``; every worker's next call to them is refused locally
  (``ProviderBlocked``, no network), and the step runner hands the job back to wait queued
  with no attempt counted (a job whose own call met the refusal: once; processors/
  attempt.py). A probe call every ``provider_probe_seconds`` lifts the block when it
  succeeds, and releases the waiting jobs; so does ``calmq provider unblock``.
- A rate limit pauses the provider and model for the ``retry-after-ms`` / ``retry-after``
  the provider sent (at most ``provider_retry_after_max_seconds``: calmq.calls.wires),
  fleet-wide (the same table and channel): a call waits here until then, with or without a
  token budget. ``calmq provider unpause`` lifts it early.

``ProviderGate`` is one process's copy of one provider and model's state, kept current by
the notifications and, as a safety net, a read every few seconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING, Any

from prometheus_client import Counter, Gauge

from calmq.calls.wires import current_scope
from calmq.errors import StepFailure
from calmq.failure_codes import ModelsCooling, ProviderBlocked, spec
from calmq.retrying import Backoff, Reconnect
from calmq.supervision import Supervisor

if TYPE_CHECKING:
    from calmq.data.database import Database
    from calmq.data.providers import ProviderLedger, ProviderState

__all__ = ["Block", "ProviderGate", "block_reason", "provider_key", "provider_label"]

log = logging.getLogger(__name__)

# Why a block, by the failure code that caused it (the metric's reason label).
_REASONS = {"provider_auth": "invalid_api_key", "provider_permission": "permission_denied",
            "model_not_found": "model_not_found", "insufficient_quota": "insufficient_quota"}
_REFRESH_SECONDS = 2.0
_LISTEN_RETRY = Backoff(initial=0.5, maximum=10.0)
# A second job's refusal confirms a block only this soon after the first's: two jobs that
# met a firewall's 403 an hour apart say nothing about the key.
_SECOND_JOB_SECONDS = 60.0
# The confirming probe runs inside the failed job's attempt: it must not take the step's
# whole timeout when the provider does not answer (no answer: it cannot tell).
_PROBE_TIMEOUT_SECONDS = 20.0


def block_reason(code: str) -> str:
    return _REASONS.get(code, code)


def provider_key(kind: str, url: str, api_key: str) -> str:
    """What a block or a rate-limit pause names: the endpoint (``kind:base URL``) and the
    API key it was sent with (a fingerprint, never the key). A 429 is the quota of one key:
    a fleet that calls one endpoint with two keys cools down only the key the provider
    named."""
    key = f"{kind}:{url.rstrip('/')}"
    if not api_key:
        return key
    return f"{key}#key-{hashlib.sha256(api_key.encode()).hexdigest()[:10]}"


def provider_label(provider: str) -> str:
    """The metric label of a provider key (``kind:base URL``): its kind, a bounded set."""
    return provider.split(":", 1)[0]


@cache
def _blocked_gauge() -> Gauge:
    return Gauge("calmq_provider_blocked", "1 while the provider and model are blocked "
                 "fleet-wide (a bad key, permission, model, billing): why in reason",
                 ["provider", "model", "reason"])


@cache
def _unconfirmed_counter() -> Counter:
    return Counter("calmq_provider_refusals_unconfirmed_total", "401/403/404/billing answers "
                   "that no probe call or second job confirmed: the job's own failure, no "
                   "fleet-wide block (a firewall refusing one prompt, a model one request "
                   "names)", ["provider", "model", "code"])


@cache
def _paused_gauge() -> Gauge:
    return Gauge("calmq_provider_paused_seconds", "Seconds left of a fleet-wide rate-limit "
                 "pause of the provider and model (the provider's retry-after)",
                 ["provider", "model"])


@dataclass(frozen=True)
class Block:
    reason: str
    code: str
    message: str


@dataclass(frozen=True)
class _Suspect:
    """A refusal no one confirmed yet: which job (and tenant) met it, and when."""

    job_id: str
    tenant_id: str
    at: float

    def confirmed_by(self, job_id: str, tenant_id: str, now: float) -> bool:
        """Whether the same code met by ``job_id`` now confirms it: another job, of another
        tenant where both are known (a tenant's own jobs that trip a firewall alike must not
        block the others), soon enough."""
        return (now - self.at <= _SECOND_JOB_SECONDS and job_id != self.job_id
                and not (tenant_id and tenant_id == self.tenant_id))


class ProviderGate:
    """One process's gate in front of one provider and model (see the module)."""

    def __init__(self, provider: str, model: str, *, ledger: ProviderLedger | None = None,
                 db: Database | None = None,
                 probe: Callable[[], Awaitable[object]] | None = None,
                 probe_seconds: float = 15.0,
                 on_unblocked: Callable[[], Awaitable[object]] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.provider = provider
        self.model = model
        self.ledger = ledger
        self._db = db
        self._probe = probe
        self.probe_seconds = probe_seconds
        self._on_unblocked = on_unblocked
        self._clock = clock
        self.blocked: Block | None = None
        self.paused_until = 0.0
        # Told when a rate-limit pause is lifted early (`calmq provider unpause`): the token
        # budget of this provider and model holds its own copy of the pause.
        self.on_unpaused: Callable[[], None] | None = None
        self._lifted = asyncio.Event()  # set (and replaced) when a pause is lifted early
        self._side: Supervisor | None = None
        self._label = provider_label(provider)
        # Unconfirmed refusals by code, and the confirming probe while it runs (the failures
        # that arrive meanwhile share it rather than each sending one).
        self._suspects: dict[str, _Suspect] = {}
        self._checking: asyncio.Task[StepFailure | bool | None] | None = None

    # -- the calls --------------------------------------------------------------------

    async def admit(self, *, wait: bool = True) -> None:
        """Before a call: refuse it while blocked; wait out a rate-limit pause (``wait``
        False: refuse it with ``ModelsCooling``, for a step that has another model)."""
        while True:
            if self.blocked is not None:
                raise self._refusal(self.blocked)
            left = self.paused_until - self._clock()
            if left <= 0:
                return
            if not wait:
                raise ModelsCooling(left, [self.model])
            # The provider's own retry-after, cut short when the pause is lifted early.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(left):
                    await self._lifted.wait()

    def refusal(self) -> ProviderBlocked:
        """The refusal of a call while blocked."""
        assert self.blocked is not None, "not blocked"
        return self._refusal(self.blocked)

    def cooling_seconds(self) -> float:
        """Seconds left of a rate-limit pause (0: none): a step with other allowed models
        calls one of them meanwhile (calmq.calls.fallback)."""
        return max(0.0, self.paused_until - self._clock())

    def _refusal(self, block: Block, *, met: bool = False) -> ProviderBlocked:
        return ProviderBlocked(
            f"{self._label} model {self.model} is blocked fleet-wide ({block.reason}): "
            f"{block.message[:300]}", code=block.code, provider=self.provider,
            model=self.model, met=met)

    async def failed(self, failure: StepFailure) -> StepFailure:
        """After a failed call: block (once confirmed) or pause as its code says; returns
        what to raise: ``ProviderBlocked`` (``met``) when the provider and model are
        blocked, else the failure itself, the job's own."""
        entry = spec(failure.code, failure.failure_class)
        if entry.pauses:
            if self.blocked is not None:  # confirmed meanwhile, here or by another worker
                return self._refusal(self.blocked, met=True)
            confirmed = await self._confirmation(failure)
            if self.blocked is not None:  # confirmed while the probe ran
                return self._refusal(self.blocked, met=True)
            if confirmed is None:
                _unconfirmed_counter().labels(self._label, self.model, failure.code).inc()
                log.warning("%s model %s refused one job's call (%s), unconfirmed by a probe "
                            "or a second job: that job's own failure, no block", self._label,
                            self.model, failure.code)
                return failure
            block = Block(block_reason(confirmed.code), confirmed.code, confirmed.message)
            self._suspects.clear()
            self._set_blocked(block)
            log.error("blocking %s model %s fleet-wide: %s", self._label, self.model,
                      confirmed.message[:300])
            if self.ledger is not None:
                await self.ledger.block(self.provider, self.model, block.reason, block.code,
                                        block.message)
            return self._refusal(block, met=True)
        if failure.code == "rate_limited" and failure.retry_after is not None:
            await self.pause(failure.retry_after)
        return failure

    async def _confirmation(self, failure: StepFailure) -> StepFailure | None:
        """What confirms that ``failure`` (a ``pause`` code) is the provider's and not the
        job's: the probe's own refusal, or ``failure`` when a second job of another tenant
        met the same code; None when unconfirmed (the probe succeeded, or it could not tell
        and no other job met it)."""
        probed = await self._probe_verdict()
        if isinstance(probed, StepFailure):
            return probed
        if probed is True:
            # A neutral request went through with the same key and model: this refusal was
            # about the job's request, and so were the earlier ones.
            self._suspects.clear()
            return None
        scope = current_scope()
        now = self._clock()
        seen = self._suspects.get(failure.code)
        if seen is not None and seen.confirmed_by(scope.job_id, scope.tenant_id, now):
            return failure
        self._suspects[failure.code] = _Suspect(scope.job_id, scope.tenant_id, now)
        return None

    async def _probe_verdict(self) -> StepFailure | bool | None:
        """The probe's answer: its refusal when it met a ``pause`` code too, True when it
        succeeded, None without a probe or when it could not tell."""
        if self._probe is None:
            return None
        if self._checking is None or self._checking.done():
            self._checking = asyncio.ensure_future(self._check())
        # Shielded: a job's attempt that ends (its step's timeout) does not cancel the probe
        # the other failed calls wait for.
        return await asyncio.shield(self._checking)

    async def _check(self) -> StepFailure | bool | None:
        assert self._probe is not None
        try:
            async with asyncio.timeout(_PROBE_TIMEOUT_SECONDS):
                await self._probe()
        except StepFailure as refused:
            if spec(refused.code, refused.failure_class).pauses:
                return refused
            log.info("the confirming probe of %s model %s could not tell (%s)", self._label,
                     self.model, refused.code)
            return None
        except Exception as exc:  # noqa: BLE001 - a probe that failed otherwise tells nothing
            log.info("the confirming probe of %s model %s could not tell: %r", self._label,
                     self.model, exc)
            return None
        return True

    async def pause(self, seconds: float) -> None:
        """Pause this provider and model for ``seconds``, here at once and fleet-wide."""
        self._pause_local(seconds)
        if self.ledger is not None:
            await self.ledger.pause(self.provider, self.model, seconds)

    def _unpause_local(self) -> None:
        self.paused_until = 0.0
        self._lifted.set()  # the calls waiting out the pause go now
        self._lifted = asyncio.Event()
        _paused_gauge().labels(self._label, self.model).set(0)
        if self.on_unpaused is not None:
            self.on_unpaused()

    def _pause_local(self, seconds: float) -> None:
        until = self._clock() + max(0.0, seconds)
        if until > self.paused_until:
            self.paused_until = until
            _paused_gauge().labels(self._label, self.model).set(seconds)

    def _set_blocked(self, block: Block | None) -> None:
        old = self.blocked
        self.blocked = block
        gauge = _blocked_gauge()
        if old is not None and (block is None or block.reason != old.reason):
            gauge.labels(self._label, self.model, old.reason).set(0)
        if block is not None:
            gauge.labels(self._label, self.model, block.reason).set(1)

    # -- keeping current ------------------------------------------------------------------

    def apply(self, state: ProviderState) -> None:
        """The state as the database holds it."""
        if state.provider != self.provider or state.model != self.model:
            return
        if state.blocked_reason is None:
            self._set_blocked(None)
        else:
            self._set_blocked(Block(state.blocked_reason, state.blocked_code or "",
                                    state.blocked_message or ""))
        if state.paused_seconds > 0:
            self._pause_local(state.paused_seconds)

    def notified(self, payload: str) -> None:
        """A notification on ``calmq_providers`` (from any worker, or the CLI)."""
        try:
            event = json.loads(payload)
        except ValueError:
            return
        if event.get("provider") != self.provider and event.get("provider") is not None:
            return
        if event.get("model") not in (self.model, None):
            return
        kind = event.get("event")
        if kind == "blocked":
            self._set_blocked(Block(str(event.get("reason")), str(event.get("code")),
                                    str(event.get("message", ""))))
        elif kind == "unblocked":
            self._set_blocked(None)
        elif kind == "paused":
            self._pause_local(float(event.get("seconds") or 0))
        elif kind == "unpaused":
            self._unpause_local()

    async def refresh(self) -> None:
        if self.ledger is None:
            return
        found = False
        for state in await self.ledger.states():
            if state.provider == self.provider and state.model == self.model:
                found = True
                self.apply(state)
        if not found:
            self._set_blocked(None)

    async def probe_once(self) -> bool:
        """While blocked: one tiny call; True when it succeeded and the block was lifted."""
        if self.blocked is None or self._probe is None:
            return False
        try:
            await self._probe()
        except StepFailure as failure:
            log.info("probe of blocked %s model %s: still failing (%s)", self._label,
                     self.model, failure.code)
            return False
        log.warning("probe of %s model %s succeeded: lifting its block", self._label,
                    self.model)
        await self.unblock()
        return True

    async def unblock(self) -> None:
        self._set_blocked(None)
        if self.ledger is not None:
            await self.ledger.unblock(self.provider, self.model)
        if self._on_unblocked is not None:
            await self._on_unblocked()

    async def _listen(self) -> None:
        from calmq.data.database import listen_connection
        from calmq.data.providers import CHANNEL

        assert self._db is not None
        reconnect = Reconnect("listening for provider states failed", _LISTEN_RETRY)
        while True:
            try:
                async with await listen_connection(self._db.url) as conn:
                    await conn.execute(f"LISTEN {CHANNEL}")
                    await self.refresh()  # what was announced before the LISTEN
                    reconnect.succeeded()
                    async for note in conn.notifies():
                        self.notified(note.payload)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 - the database is away: listen again
                await asyncio.sleep(reconnect.failed(exc))  # an outage's pause, not a sync

    def start(self) -> None:
        """The listener, the safety-net read and the probe, as side tasks of this gate."""
        if self.ledger is None or self._side is not None:
            return
        side = Supervisor()
        if self._db is not None:
            side.spawn(f"provider-listen-{self.model}", self._listen)
        side.every(f"provider-refresh-{self.model}", _REFRESH_SECONDS, self.refresh,
                   first_after=_REFRESH_SECONDS)
        if self._probe is not None:
            side.every(f"provider-probe-{self.model}", self.probe_seconds, self.probe_once,
                       first_after=self.probe_seconds)
        self._side = side

    async def close(self) -> None:
        if self._checking is not None and not self._checking.done():
            self._checking.cancel()
        if self._side is not None:
            with contextlib.suppress(Exception):
                await self._side.stop()
            self._side = None

    def describe(self) -> dict[str, Any]:
        left = max(0.0, self.paused_until - self._clock())
        return {"provider": self.provider, "model": self.model,
                "blocked": None if self.blocked is None else self.blocked.reason,
                "paused_seconds": round(left, 3)}
