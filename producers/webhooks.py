"""Webhook callbacks: who may be called, how a callback is signed, and the dispatcher.

A terminal job event (completed, dead_lettered, cancelled) of a job with a
``callback_url`` becomes a ``webhook_deliveries`` row in the same transaction as the event
(trigger of migration 0004), so no callback is lost when a process dies. The dispatcher
runs inside every API process: it claims due rows with SKIP LOCKED, POSTs the job's status
document, records each attempt in ``webhook_attempts`` and retries up to
``webhook_max_attempts`` with the kernel's backoff (calmq.retrying: exponential, jittered
over each attempt's band, so a later retry never comes sooner than an earlier one).

One tenant's endpoint cannot slow the others' callbacks: each delivery is sent on its own
(the dispatcher does not wait for a claim's slowest send before claiming again), a tenant
has at most ``webhook_slots_per_tenant`` deliveries in flight in a process (the claim
skips a tenant holding them all), and a connect that is never answered ends after
``webhook_connect_timeout_seconds`` (the whole POST after ``webhook_timeout_seconds``).

Where a callback may connect: the submit checks every address the host resolves to, and at
send time the dispatcher's connector resolves through :class:`PinnedResolver`, which keeps
only allowed addresses, so what was checked is what is connected to (DNS rebinding cannot
reach loopback). Translated IPv6 addresses (IPv4-mapped, NAT64, 6to4) are judged by the
IPv4 address inside. At most ``ANSWER_READ_BYTES`` of an answer are read.

The body (setting ``webhook_payload_version``): version 2, the default, is the Standard
Webhooks shape ``{"type": "job.completed", "timestamp": "<ISO 8601, when the event was
recorded>", "data": <the job's status document>}``; version 1 is calmq's first
``{"event": "completed", "job": <the job's status document>}``, kept for one release so a
receiver can move when it is ready (docs/how-to/webhooks.md).

Signatures: Standard Webhooks (``webhook-id``/``-timestamp``/``-signature``, one ``v1,``
signature per valid secret: two during a rotation's grace) and calmq's first, Stripe-style
scheme (verifiable with :func:`verify`, newest secret only)::

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
import uuid
from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any
from urllib.parse import urlparse

import aiohttp
from aiohttp.abc import AbstractResolver, ResolveResult
from aiohttp.resolver import ThreadedResolver

from calmq.data import JobDetail, Store
from calmq.data.webhooks import DeliveryStatus, WebhookDeliveries, WebhookDelivery
from calmq.errors import ContractError
from calmq.producers.timestamps import format_time
from calmq.retrying import Backoff
from calmq.settings import Settings

__all__ = [
    "ANSWER_READ_BYTES",
    "SIGNATURE_HEADER",
    "TIMESTAMP_HEADER",
    "Dispatcher",
    "ForbiddenAddress",
    "PinnedResolver",
    "Sender",
    "check_callback_url",
    "embedded_ipv4",
    "forbidden_address",
    "sign",
    "signed_headers",
    "standard_secret",
    "verify",
    "webhook_body",
]

log = logging.getLogger(__name__)

TIMESTAMP_HEADER = "Calmq-Timestamp"
SIGNATURE_HEADER = "Calmq-Signature"


def webhook_body(version: int, event_type: str, occurred_at: datetime,
                 job: Mapping[str, Any]) -> bytes:
    """The body of a callback for ``event_type`` (``completed``, ``dead_lettered``,
    ``cancelled``) in payload ``version`` 2 (Standard Webhooks) or 1 (calmq's first)."""
    payload: dict[str, Any]
    if version == 1:
        payload = {"event": event_type, "job": job}
    else:
        # The standard's type is "<group>.<event>": receivers route on it, and other
        # resources' events can join the group later without a clash.
        payload = {"type": f"job.{event_type}", "timestamp": format_time(occurred_at),
                   "data": job}
    return json.dumps(payload, separators=(",", ":")).encode()


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


def signed_headers(secret: str, message_id: str, timestamp: int, body: bytes,
                   previous: str | None = None) -> dict[str, str]:
    """Both schemes' headers: Standard Webhooks (``webhook-id``, ``webhook-timestamp``,
    ``webhook-signature``; any of its libraries verifies them) and calmq's own.

    During a secret rotation's grace ``previous`` is the replaced secret: the standard
    header then carries one signature per secret, space-separated (the scheme allows
    several; a receiver accepts any that verifies), the newest first. ``Calmq-Signature``
    has room for one and is signed with the newest only.
    """
    standard = [_standard_signature(s, message_id, timestamp, body)
                for s in (secret, previous) if s]
    return {
        "webhook-id": message_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(dict.fromkeys(standard)),
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


# IPv6 ranges that carry an IPv4 address in their last 32 bits and reach it through a
# translator (NAT64, RFC 6052 and the local-use prefix of RFC 8215) or that are the old
# IPv4-compatible form: judged by the IPv4 address inside, as a mapped address is.
_EMBEDDING_V4 = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("64:ff9b:1::/48"),
                 ipaddress.IPv6Network("::/96"))


def embedded_ipv4(ip: ipaddress.IPv4Address | ipaddress.IPv6Address
                  ) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 address reaches: IPv4-mapped (``::ffff:a.b.c.d``), 6to4
    (``2002:AABB:CCDD::/48``), NAT64 (``64:ff9b::/96``, ``64:ff9b:1::/48``) or
    IPv4-compatible (``::a.b.c.d``); None for any other address."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    if ip.sixtofour is not None:
        return ip.sixtofour
    if any(ip in net for net in _EMBEDDING_V4) and int(ip) & 0xFFFFFFFF:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    return None


def forbidden_address(address: str) -> bool:
    """Whether a callback may not connect to ``address``: anything but a global unicast
    address, judged for a translated IPv6 address by the IPv4 address it embeds."""
    try:
        ip: ipaddress.IPv4Address | ipaddress.IPv6Address = ipaddress.ip_address(
            address.split("%", 1)[0])
    except ValueError:
        return True
    inner = embedded_ipv4(ip)
    if inner is not None and (not inner.is_global or inner.is_multicast):
        return True
    return not ip.is_global or ip.is_multicast


class ForbiddenAddress(OSError):
    """A callback host resolved to no address it may connect to (raised by the resolver
    inside aiohttp's connector, which wraps it in ClientConnectorDNSError)."""


_REFUSED = ("callback_url resolves to a private or loopback address ({}); "
            "set CALMQ_WEBHOOK_ALLOW_PRIVATE=true to allow it for local use")


class PinnedResolver(AbstractResolver):
    """The dispatcher's resolver: resolves a callback host once, drops every forbidden
    address and hands aiohttp only the allowed ones, so the address checked is the address
    connected to (a name that rebinds to loopback between a check and the connect cannot
    reach it). The URL's name stays the Host header and the TLS server name: aiohttp asks
    the resolver for addresses only.

    ``inner`` does the lookup (aiohttp's ThreadedResolver, getaddrinfo, by default; a test
    gives one of its own); with ``allow_private`` every address passes.
    """

    def __init__(self, inner: AbstractResolver | None = None, *,
                 allow_private: bool = False) -> None:
        self._inner = inner or ThreadedResolver()
        self._allow_private = allow_private

    async def resolve(self, host: str, port: int = 0,
                      family: socket.AddressFamily = socket.AF_INET) -> list[ResolveResult]:
        found = await self._inner.resolve(host, port, family)
        if self._allow_private:
            return found
        allowed = [r for r in found if not forbidden_address(r["host"])]
        if not allowed:
            raise ForbiddenAddress(_REFUSED.format(
                ", ".join(sorted({r["host"] for r in found})) or "none"))
        return allowed

    async def close(self) -> None:
        await self._inner.close()


def _callback_target(url: str) -> tuple[str, int]:
    """The host and port of a well-formed callback URL; ContractError 422 otherwise."""
    parsed = urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ContractError("callback_url must be an absolute http or https URL",
                            code="invalid_callback_url", status=422)
    try:
        port = parsed.port or (443 if parsed.scheme == "https" else 80)
    except ValueError as exc:
        raise ContractError("callback_url has an invalid port", code="invalid_callback_url",
                            status=422) from exc
    return parsed.hostname, port


def _is_ip_literal(host: str) -> bool:
    try:
        ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return False
    return True


async def check_callback_url(url: str, *, allow_private: bool) -> None:
    """ContractError 422 unless ``url`` is http(s) and every address it resolves to is public.

    This is the submit-time check (a clear answer to the caller); at send time the
    dispatcher's :class:`PinnedResolver` filters the addresses it connects to.
    """
    host, port = _callback_target(url)
    if allow_private:
        return
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        raise ContractError(f"callback_url host {host!r} does not resolve",
                            code="invalid_callback_url", status=422) from exc
    bad = sorted({str(i[4][0]) for i in infos if forbidden_address(str(i[4][0]))})
    if bad:
        raise ContractError(_REFUSED.format(", ".join(bad)), code="callback_url_forbidden",
                            status=422)


# How much of a receiver's answer is read: its status is what counts, and a receiver that
# answers with an endless body must not hold a dispatcher slot or its memory.
ANSWER_READ_BYTES = 4096


class Sender:
    """The dispatcher's HTTP side: one session whose connector resolves through a
    :class:`PinnedResolver`, POSTs that follow no redirect, and at most
    ``ANSWER_READ_BYTES`` of each answer read."""

    def __init__(self, settings: Settings, resolver: AbstractResolver | None = None) -> None:
        self._settings = settings
        self._resolver = resolver
        self._session: aiohttp.ClientSession | None = None

    def _open(self) -> aiohttp.ClientSession:
        if self._session is None:
            allow = self._settings.webhook_allow_private
            connector = aiohttp.TCPConnector(
                resolver=PinnedResolver(self._resolver, allow_private=allow))
            # A connect that is dropped (a blackholed address) ends early: the rest of the
            # total is for an endpoint that did answer the connect.
            self._session = aiohttp.ClientSession(
                connector=connector, trust_env=False,
                timeout=aiohttp.ClientTimeout(
                    total=self._settings.webhook_timeout_seconds,
                    sock_connect=min(self._settings.webhook_connect_timeout_seconds,
                                     self._settings.webhook_timeout_seconds)))
        return self._session

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def post(self, url: str, body: bytes, headers: Mapping[str, str]
                   ) -> tuple[int | None, str | None, bool]:
        """``(status code, error, final)``: error None for a 2xx; ``final`` when retrying
        cannot help (a malformed or forbidden target)."""
        try:
            host, _port = _callback_target(url)
            # aiohttp connects to an IP literal without asking the resolver: check it here.
            if (_is_ip_literal(host) and not self._settings.webhook_allow_private
                    and forbidden_address(host)):
                raise ContractError(_REFUSED.format(host), code="callback_url_forbidden")
            async with self._open().post(url, data=body, headers=dict(headers),
                                         allow_redirects=False) as resp:
                status_code = resp.status
                await resp.content.read(ANSWER_READ_BYTES)
                if not resp.content.at_eof():
                    resp.close()  # drop the connection rather than read the rest
        except ContractError as exc:
            return None, exc.message, True  # a refused target never becomes allowed
        except aiohttp.ClientConnectorDNSError as exc:
            if isinstance(exc.os_error, ForbiddenAddress):
                return None, str(exc.os_error), True
            return None, f"{type(exc).__name__}: {exc}", False
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            return None, f"{type(exc).__name__}: {exc}", False
        if not 200 <= status_code < 300:
            return status_code, f"HTTP {status_code}", False
        return status_code, None, False


# Deliveries one dispatcher sends at once, all tenants together.
MAX_IN_FLIGHT = 64


class Dispatcher:
    """Delivers due webhook rows; woken by NOTIFY calmq_webhooks, else by the next due time."""

    def __init__(self, settings: Settings, store: Store,
                 view: Callable[[JobDetail], dict[str, Any]],
                 resolver: AbstractResolver | None = None) -> None:
        self._settings = settings
        self._store = store
        self._view = view
        self._deliveries = WebhookDeliveries(store)
        self._wake = asyncio.Event()
        # ``resolver`` looks callback hosts up (getaddrinfo by default); the sender filters
        # its answers, so it decides which addresses a delivery may connect to.
        self._sender = Sender(settings, resolver)
        # What this dispatcher is sending: one task per delivery, counted per tenant.
        self._sending: set[asyncio.Task[None]] = set()
        self._held: dict[uuid.UUID, int] = {}

    def wake(self) -> None:
        self._wake.set()

    def held(self, tenant_id: uuid.UUID) -> int:
        """Deliveries of ``tenant_id`` this dispatcher is sending now."""
        return self._held.get(tenant_id, 0)

    async def close(self) -> None:
        """Stop the sends in flight (their rows are tried again when their lease ends) and
        close the HTTP session (after the side task running ``run`` stopped)."""
        for task in list(self._sending):
            task.cancel()
        await asyncio.gather(*self._sending, return_exceptions=True)
        await self._sender.close()

    async def run(self) -> None:
        """Deliver until cancelled: the API runs this as a side task (calmq.supervision)."""
        while True:
            try:
                started = await self.deliver_due()
                wait = 0.0 if started else await self._next_due()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("webhook dispatch failed; trying again shortly")
                wait = 1.0
            if wait > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout=wait)
            self._wake.clear()

    def _full(self) -> list[uuid.UUID]:
        slots = self._settings.webhook_slots_per_tenant
        return [t for t, n in self._held.items() if n >= slots]

    async def _next_due(self) -> float:
        if len(self._sending) >= MAX_IN_FLIGHT:
            return 30.0  # a send that ends wakes the loop
        seconds = await self._deliveries.next_due(self._full())
        if seconds is None:
            return 30.0
        return max(0.01, min(30.0, seconds))

    async def deliver_due(self, limit: int = 32) -> int:
        """Claim due deliveries for the free slots (up to ``limit``) and start sending each
        on its own; returns how many were started. A send that ends frees its slot and
        wakes ``run`` to claim again."""
        room = min(limit, MAX_IN_FLIGHT - len(self._sending))
        if room <= 0:
            return 0
        lease = self._settings.webhook_timeout_seconds * 2 + 5
        due = await self._deliveries.claim(room, lease,
                                           per_tenant=self._settings.webhook_slots_per_tenant,
                                           held=self._held)
        for delivery in due:
            self._held[delivery.tenant_id] = self._held.get(delivery.tenant_id, 0) + 1
            task = asyncio.create_task(self._send(delivery))
            self._sending.add(task)
        return len(due)

    async def _send(self, delivery: WebhookDelivery) -> None:
        try:
            await self._deliver(delivery)
        except asyncio.CancelledError:
            raise
        except Exception:
            # Its lease ends and it is tried again: the attempt was not recorded.
            log.exception("webhook %s for job %s failed before it was recorded", delivery.id,
                          delivery.job_id)
        finally:
            left = self._held.get(delivery.tenant_id, 1) - 1
            if left > 0:
                self._held[delivery.tenant_id] = left
            else:
                self._held.pop(delivery.tenant_id, None)
            task = asyncio.current_task()
            if task is not None:
                self._sending.discard(task)
            self._wake.set()

    async def _deliver(self, delivery: WebhookDelivery) -> None:
        job = await self._store.jobs.view(delivery.tenant_id, delivery.job_id)
        body = webhook_body(self._settings.webhook_payload_version, delivery.event_type,
                            delivery.created_at,
                            self._view(job) if job else {"job_id": str(delivery.job_id)})
        ts = int(time.time())
        # webhook-id is the delivery's id: the same on every retry, so a receiver that
        # de-duplicates on it (as Standard Webhooks asks) handles a redelivery once.
        headers = {"Content-Type": "application/json",
                   **signed_headers(delivery.webhook_secret, str(delivery.id), ts, body,
                                    delivery.webhook_secret_previous),
                   "Calmq-Delivery": str(delivery.id), "User-Agent": "calmq-webhooks"}
        started = time.monotonic()
        status_code, error, final = await self._sender.post(delivery.url, body, headers)
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
