"""Webhook callbacks: who may be called, how a callback is signed, and the dispatcher.

A terminal job event (completed, dead_lettered, cancelled) of a job with a
``callback_url`` becomes a ``webhook_deliveries`` row in the same transaction as the event
(trigger of migration 0004), so no callback is lost when a process dies. The dispatcher
runs inside every API process: it claims due rows with SKIP LOCKED, POSTs the job's status
document, records each attempt in ``webhook_attempts`` and retries up to
``webhook_max_attempts`` with the kernel's backoff (calmq.retrying: exponential, jittered
over each attempt's band, so a later retry never comes sooner than an earlier one).

Signature (Stripe-style, verifiable with :func:`verify`)::

    Calmq-Timestamp: <unix seconds>
    Calmq-Signature: v1=<hex HMAC-SHA256(tenant webhook secret, "<timestamp>.<body>")>
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import ipaddress
import json
import logging
import math
import socket
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import urlparse

import aiohttp

from calmq.data import JobDetail, Store
from calmq.data.webhooks import DeliveryStatus, WebhookDeliveries, WebhookDelivery
from calmq.errors import ContractError
from calmq.retrying import Backoff
from calmq.settings import Settings

__all__ = [
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "Dispatcher",
    "check_callback_url",
    "sign",
    "signed_headers",
    "standard_secret",
    "verify",
]

log = logging.getLogger(__name__)

TIMESTAMP_HEADER = "Calmq-Timestamp"
SIGNATURE_HEADER = "Calmq-Signature"


def sign(secret: str, timestamp: int, body: bytes) -> str:
    """calmq's first scheme (``Calmq-Signature``), kept for one release beside the standard."""
    mac = hmac.new(secret.encode(), f"{timestamp}.".encode() + body, hashlib.sha256)
    return "v1=" + mac.hexdigest()


def standard_secret(secret: str) -> str:
    """The tenant's secret as Standard Webhooks libraries take it: ``whsec_`` + base64.

    The key bytes are the same as for ``Calmq-Signature`` (the UTF-8 of the stored secret),
    so one stored secret verifies both schemes.
    """
    return "whsec_" + base64.b64encode(secret.encode()).decode()


def _standard_signature(secret: str, message_id: str, timestamp: int, body: bytes) -> str:
    # Standard Webhooks v1: base64 HMAC-SHA256 over "<webhook-id>.<webhook-timestamp>.<body>".
    signed = f"{message_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret.encode(), signed, hashlib.sha256)
                                    .digest()).decode()


def signed_headers(secret: str, message_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """Both schemes' headers: Standard Webhooks (``webhook-id``, ``webhook-timestamp``,
    ``webhook-signature``; any of its libraries verifies them) and calmq's own."""
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": _standard_signature(secret, message_id, timestamp, body),
        TIMESTAMP_HEADER: str(timestamp),
        SIGNATURE_HEADER: sign(secret, timestamp, body),
    }


def verify(secret: str, headers: Mapping[str, str], body: bytes, *, tolerance: float = 300,
           now: float | None = None) -> bool:
    """Whether a received callback is genuine and fresh (within ``tolerance`` seconds)."""
    try:
        ts = int(headers[TIMESTAMP_HEADER])
    except (KeyError, ValueError):
        return False
    if abs((time.time() if now is None else now) - ts) > tolerance:
        return False
    given = headers.get(SIGNATURE_HEADER, "")
    return hmac.compare_digest(given, sign(secret, ts, body))


def _forbidden(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return not ip.is_global or ip.is_multicast


async def check_callback_url(url: str, *, allow_private: bool) -> None:
    """ContractError 422 unless ``url`` is http(s) and every address it resolves to is public."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ContractError("callback_url must be an absolute http or https URL",
                            code="invalid_callback_url", status=422)
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError as exc:
        raise ContractError("callback_url has an invalid port", code="invalid_callback_url",
                            status=422) from exc
    if allow_private:
        return
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(
            parsed.hostname, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ContractError(f"callback_url host {parsed.hostname!r} does not resolve",
                            code="invalid_callback_url", status=422) from exc
    bad = sorted({str(i[4][0]) for i in infos if _forbidden(str(i[4][0]))})
    if bad:
        raise ContractError(
            f"callback_url resolves to a private or loopback address ({', '.join(bad)}); "
            "set CALMQ_WEBHOOK_ALLOW_PRIVATE=true to allow it for local use",
            code="callback_url_forbidden", status=422,
        )


class Dispatcher:
    """Delivers due webhook rows; woken by NOTIFY calmq_webhooks, else by the next due time."""

    def __init__(self, settings: Settings, store: Store,
                 view: Callable[[JobDetail], dict[str, Any]]) -> None:
        self._settings = settings
        self._store = store
        self._view = view
        self._deliveries = WebhookDeliveries(store)
        self._wake = asyncio.Event()
        self._session: aiohttp.ClientSession | None = None

    def wake(self) -> None:
        self._wake.set()

    async def close(self) -> None:
        """Close the HTTP session (after the side task running ``run`` stopped)."""
        if self._session is not None:
            await self._session.close()

    async def run(self) -> None:
        """Deliver until cancelled: the API runs this as a side task (calmq.supervision)."""
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=self._settings.webhook_timeout_seconds))
        while True:
            try:
                sent = await self.deliver_due()
                wait = 0.0 if sent else await self._next_due()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("webhook dispatch failed; trying again shortly")
                wait = 1.0
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=wait)
            self._wake.clear()

    async def _next_due(self) -> float:
        seconds = await self._deliveries.next_due()
        if seconds is None:
            return 30.0
        return max(0.01, min(30.0, seconds))

    async def deliver_due(self, limit: int = 32) -> int:
        """Claim and send every due delivery (up to ``limit``); returns how many were tried."""
        lease = self._settings.webhook_timeout_seconds * 2 + 5
        due = await self._deliveries.claim(limit, lease)
        await asyncio.gather(*(self._deliver(d) for d in due))
        return len(due)

    async def _deliver(self, delivery: WebhookDelivery) -> None:
        job = await self._store.jobs.view(delivery.tenant_id, delivery.job_id)
        body = json.dumps({"event": delivery.event_type,
                           "job": self._view(job) if job else {"job_id": str(delivery.job_id)}},
                          separators=(",", ":")).encode()
        ts = int(time.time())
        # webhook-id is the delivery's id: the same on every retry, so a receiver that
        # de-duplicates on it (as Standard Webhooks asks) handles a redelivery once.
        headers = {"Content-Type": "application/json",
                   **signed_headers(delivery.webhook_secret, str(delivery.id), ts, body),
                   "Calmq-Delivery": str(delivery.id), "User-Agent": "calmq-webhooks"}
        started = time.monotonic()
        status_code: int | None = None
        error: str | None = None
        final = False
        try:
            # Checked again at send time: DNS may have changed since the submit.
            await check_callback_url(delivery.url,
                                     allow_private=self._settings.webhook_allow_private)
            assert self._session is not None
            async with self._session.post(delivery.url, data=body, headers=headers,
                                          allow_redirects=False) as resp:
                status_code = resp.status
                await resp.read()
            if not 200 <= status_code < 300:
                error = f"HTTP {status_code}"
        except ContractError as exc:
            error, final = exc.message, True  # a refused target never becomes allowed by retrying
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            error = f"{type(exc).__name__}: {exc}"
        duration = int((time.monotonic() - started) * 1000)
        status: DeliveryStatus
        if error is None:
            status = "delivered"
        elif final or delivery.attempts >= self._settings.webhook_max_attempts:
            status = "failed"
        else:
            status = "pending"
        base = self._settings.webhook_backoff_seconds
        delay = Backoff(base, math.inf).delay(delivery.attempts)
        await self._deliveries.record(delivery, status=status, status_code=status_code,
                                      error=error, duration_ms=duration,
                                      retry_in=max(delay, 0.05))
        if status != "delivered":
            log.info("webhook %s for job %s: %s (%s)", delivery.id, delivery.job_id, error,
                     status)
