"""The fleet's view of each provider and model: blocked (and why), paused (until when),
and the limits the provider states.

Failures are read the way the providers mean them (calmq.failure_codes):

- A bad key, a missing permission, a model the account cannot use, exhausted billing
  (``pause`` codes) block the provider and model fleet-wide: the block is written to
  PostgreSQL (``provider_states``) and announced on ``LISTEN calmq_providers``; every
  worker's next call to them is refused locally (``ProviderBlocked``, no network), and the
  step runner hands the job back to wait queued with no attempt counted. A probe call every
  ``provider_probe_seconds`` (one tiny request) lifts the block when it succeeds, and
  releases the waiting jobs; so does ``calmq provider unblock``.
- A rate limit pauses the provider and model for exactly the ``retry-after-ms`` /
  ``retry-after`` the provider sent, fleet-wide (the same table and channel): a call waits
  here until then, with or without a token budget.

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

from prometheus_client import Gauge

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
def _paused_gauge() -> Gauge:
    return Gauge("calmq_provider_paused_seconds", "Seconds left of a fleet-wide rate-limit "
                 "pause of the provider and model (the provider's retry-after)",
                 ["provider", "model"])


@dataclass(frozen=True)
class Block:
    reason: str
    code: str
    message: str


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
        self._side: Supervisor | None = None
        self._label = provider_label(provider)

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
            await asyncio.sleep(left)  # the provider's own retry-after, not a sync

    def refusal(self) -> ProviderBlocked:
        """The refusal of a call while blocked."""
        assert self.blocked is not None, "not blocked"
        return self._refusal(self.blocked)

    def cooling_seconds(self) -> float:
        """Seconds left of a rate-limit pause (0: none): a step with other allowed models
        calls one of them meanwhile (calmq.fallback)."""
        return max(0.0, self.paused_until - self._clock())

    def _refusal(self, block: Block) -> ProviderBlocked:
        return ProviderBlocked(
            f"{self._label} model {self.model} is blocked fleet-wide ({block.reason}): "
            f"{block.message[:300]}", code=block.code, provider=self.provider,
            model=self.model)

    async def failed(self, failure: StepFailure) -> StepFailure:
        """After a failed call: block or pause as its code says; returns what to raise."""
        entry = spec(failure.code, failure.failure_class)
        if entry.pauses:
            block = Block(block_reason(failure.code), failure.code, failure.message)
            fresh = self.blocked is None
            self._set_blocked(block)
            if fresh:
                log.error("blocking %s model %s fleet-wide: %s", self._label, self.model,
                          failure.message[:300])
            if self.ledger is not None:
                await self.ledger.block(self.provider, self.model, block.reason, block.code,
                                        block.message)
            return self._refusal(block)
        if failure.code == "rate_limited" and failure.retry_after is not None:
            await self.pause(failure.retry_after)
        return failure

    async def pause(self, seconds: float) -> None:
        """Pause this provider and model for ``seconds``, here at once and fleet-wide."""
        self._pause_local(seconds)
        if self.ledger is not None:
            await self.ledger.pause(self.provider, self.model, seconds)

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
        if self._side is not None:
            with contextlib.suppress(Exception):
                await self._side.stop()
            self._side = None

    def describe(self) -> dict[str, Any]:
        left = max(0.0, self.paused_until - self._clock())
        return {"provider": self.provider, "model": self.model,
                "blocked": None if self.blocked is None else self.blocked.reason,
                "paused_seconds": round(left, 3)}
