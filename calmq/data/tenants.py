"""Tenants and their API keys: create, authenticate, add and revoke keys, webhook secrets.

A key is shown once, when it is made; only its SHA-256 hash and its first 12 characters
(the prefix people name it by) are stored. Revocation commits ``revoked_at`` and sends
``NOTIFY calmq_api_keys`` in the same transaction; every API process drops its auth cache
on that notification, so a revoked key answers 401 at once (a missed notification: the cache
entry still expires after ``auth_cache_seconds``).

``Tenants(db)`` is the async side (API, CLI ``tenants create``); ``add_key``,
``revoke_keys``, ``webhook_secret`` and ``set_results_topic`` take a database URL and run
synchronously, for the CLI commands that open one connection and leave.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import psycopg
from psycopg.rows import dict_row

from calmq import sql, topics
from calmq.data.database import Database
from calmq.errors import ContractError, NotFound

__all__ = [
    "PLATFORM_TENANT",
    "ROLES",
    "ConsoleSession",
    "Tenant",
    "TenantKeys",
    "Tenants",
    "WebhookSecrets",
    "add_key",
    "hash_key",
    "key_prefix",
    "new_key",
    "parse_roles",
    "results_topics",
    "revoke_keys",
    "rotate_webhook_secret",
    "set_results_topic",
    "webhook_secret",
    "webhook_secrets",
]

_KEY_PREFIX = "cq_"

# What a key may do (migration 0013): submit (and cancel or delete its tenant's jobs),
# review (decide awaiting reviews), operate (dead letters: list, redrive). Every key reads
# its tenant's jobs. A key made without roles has all three, as every key had before.
ROLES: tuple[str, ...] = ("submit", "review", "operate")
# The tenant that holds the platform keys (`calmq tenants platform-key`).
PLATFORM_TENANT = "platform"


def parse_roles(text: str | None) -> tuple[str, ...] | None:
    """Roles from a comma list (None or "all": every role); ContractError for unknown ones."""
    if text is None or text.strip() in ("", "all"):
        return None
    roles = tuple(dict.fromkeys(r.strip() for r in text.split(",") if r.strip()))
    unknown = [r for r in roles if r not in ROLES]
    if unknown or not roles:
        raise ContractError(f"unknown role(s) {', '.join(unknown) or text!r}; roles are "
                            f"{', '.join(ROLES)} (comma-separated) or all",
                            code="invalid_roles")
    return roles


@dataclass(frozen=True, slots=True)
class Tenant:
    id: uuid.UUID
    name: str
    key_prefix: str = ""  # of the key that authenticated (for_key); "" when made, not used
    roles: tuple[str, ...] = ROLES  # of that key (a key stored without roles: all of them)
    platform: bool = False  # a platform key: the console shows every tenant

    def can(self, role: str) -> bool:
        return role in self.roles

    @property
    def identity(self) -> str:
        """Who made an API call, for audit fields (a redrive's ``by``, a review's
        ``reviewer``): the tenant and the prefix of its key, never what the body claims."""
        if not self.key_prefix:
            return f"tenant {self.name}"
        return f"tenant {self.name} key {self.key_prefix}"


@dataclass(frozen=True, slots=True)
class TenantKeys:
    """A tenant as `calmq tenants list` shows it: its keys by prefix (never the keys) and
    when it last submitted a job (keys record no use of their own)."""

    id: uuid.UUID
    name: str
    created_at: datetime
    last_job_at: datetime | None
    keys: list[dict[str, Any]]  # {"prefix", "created_at", "revoked_at"}, oldest first
    weight: float = 1.0  # its weight in every lane's fair share (calmq tenants set-weight)


@dataclass(frozen=True, slots=True)
class ConsoleSession:
    """A live console session: whose key it was opened with, and how long it has left."""

    tenant: Tenant
    seconds_left: float


def _tenant(row: dict[str, Any]) -> Tenant:
    return Tenant(row["id"], row["name"], row["key_prefix"],
                  tuple(row["roles"]) if row["roles"] is not None else ROLES,
                  bool(row["platform"]))


def new_session_token() -> str:
    """A fresh console session token (``cqs_`` and 43 URL-safe characters)."""
    return "cqs_" + secrets.token_urlsafe(32)


def new_key() -> str:
    """A fresh API key (``cq_`` and 43 URL-safe characters)."""
    return _KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> bytes:
    """What is stored of a key: its SHA-256 digest."""
    return hashlib.sha256(key.encode()).digest()


def key_prefix(key: str) -> str:
    """The part of a key that is stored in clear, to name it (list, revoke)."""
    return key[:12]


class Tenants:
    """Tenants and keys on the pool."""

    def __init__(self, db: Database) -> None:
        self._db = db
        self._q = db.q

    async def create(self, name: str) -> tuple[Tenant, str]:
        """A new tenant and its first API key (returned once; only its hash is stored)."""
        key = new_key()
        async with self._db.pool.connection() as conn, conn.transaction():
            try:
                cur = await conn.execute(self._q["create_tenant"],
                                         {"id": uuid.uuid4(), "name": name})
            except psycopg.errors.UniqueViolation as exc:
                raise ContractError(
                    f"a tenant named {name!r} exists already", code="tenant_exists", status=409
                ) from exc
            row = await cur.fetchone()
            assert row is not None
            await conn.execute(self._q["create_api_key"], {
                "id": uuid.uuid4(), "tenant_id": row["id"], "key_hash": hash_key(key),
                "key_prefix": key_prefix(key)})
        return Tenant(row["id"], row["name"], key_prefix(key)), key

    async def for_key(self, key: str) -> Tenant | None:
        """The tenant an API key belongs to, or None (unknown or revoked)."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["tenant_for_key"], {"key_hash": hash_key(key)})
            row = await cur.fetchone()
        return None if row is None else _tenant(row)

    async def open_session(self, key: str, seconds: float) -> str | None:
        """A new console session for ``key`` lasting ``seconds``: its token (returned once;
        only its hash is stored), or None when the key is unknown or revoked."""
        token = new_session_token()
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["console_session_open"], {
                "key_hash": hash_key(key), "token_hash": hash_key(token),
                "seconds": float(seconds)})
            row = await cur.fetchone()
        return token if row is not None else None

    async def for_session(self, token: str) -> ConsoleSession | None:
        """The live session of ``token`` (None: unknown, expired, signed out, or its key
        revoked)."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["tenant_for_console_session"],
                                     {"token_hash": hash_key(token)})
            row = await cur.fetchone()
        if row is None:
            return None
        return ConsoleSession(_tenant(row), float(row["seconds_left"]))

    async def close_session(self, token: str) -> None:
        """End the session of ``token`` now, in every API process."""
        async with self._db.pool.connection() as conn:
            await conn.execute(self._q["console_session_close"],
                               {"token_hash": hash_key(token)})

    async def with_keys(self, name: str | None = None) -> list[TenantKeys]:
        """Every tenant (or the one named ``name``) with its keys, by name."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._q["list_tenants"], {"name": name})
            rows = await cur.fetchall()
        return [TenantKeys(**r) for r in rows]


def add_key(database_url: str, tenant: str, roles: tuple[str, ...] | None = None, *,
            platform: bool = False) -> str:
    """A new API key for the tenant named ``tenant`` (returned once); ``roles`` None: all.

    ``platform``: the key of the platform team, made in the ``platform`` tenant (created
    on first use); the console shows it every tenant's jobs."""
    key = new_key()
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        if platform:
            conn.execute(sql.queries()["ensure_tenant"], {"id": uuid.uuid4(), "name": tenant})
        row = conn.execute(sql.queries()["add_api_key"], {
            "id": uuid.uuid4(), "name": tenant, "key_hash": hash_key(key),
            "key_prefix": key_prefix(key), "roles": list(roles) if roles else None,
            "platform": platform}).fetchone()
    if row is None:
        raise NotFound(f"no tenant named {tenant!r}", code="unknown_tenant")
    return key


def revoke_keys(database_url: str, tenant: str, prefix: str | None = None) -> list[str]:
    """Revoke the tenant's key with this prefix (its first 12 characters), or all of them;
    returns the revoked keys' prefixes."""
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        rows = conn.execute(sql.queries()["revoke_api_keys"], {
            "name": tenant, "key_prefix": key_prefix(prefix) if prefix else None}).fetchall()
    return [str(r["key_prefix"]) for r in rows]


@dataclass(frozen=True, slots=True)
class WebhookSecrets:
    """The secret that signs a tenant's callbacks, and the one a rotation replaced while it
    still signs too (until ``previous_until``)."""

    current: str
    previous: str | None
    previous_until: datetime | None


def webhook_secrets(database_url: str, tenant: str) -> WebhookSecrets:
    """The tenant's webhook secrets (the previous one only while its grace lasts)."""
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        row = conn.execute(sql.queries()["tenant_webhook_secret"], {"name": tenant}).fetchone()
    if row is None:
        raise NotFound(f"no tenant named {tenant!r}", code="unknown_tenant")
    return WebhookSecrets(str(row["webhook_secret"]), row["webhook_secret_previous"],
                          row["webhook_secret_previous_until"])


def webhook_secret(database_url: str, tenant: str) -> str:
    """The secret that signs the tenant's webhook callbacks (the newest, after a rotation)."""
    return webhook_secrets(database_url, tenant).current


def rotate_webhook_secret(database_url: str, tenant: str, grace_seconds: float
                          ) -> WebhookSecrets:
    """A new webhook secret for the tenant; the replaced one keeps signing deliveries beside
    it for ``grace_seconds`` (0: not at all)."""
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        row = conn.execute(sql.queries()["rotate_webhook_secret"], {
            "name": tenant, "grace_seconds": float(grace_seconds)}).fetchone()
    if row is None:
        raise NotFound(f"no tenant named {tenant!r}", code="unknown_tenant")
    return WebhookSecrets(str(row["webhook_secret"]), row["webhook_secret_previous"],
                          row["webhook_secret_previous_until"])


def set_results_topic(database_url: str, tenant: str, topic: str | None) -> None:
    """Route the tenant's results to ``topic`` (and its dead letters to ``topic.dlq``) from
    the next event on; None: back to the shared calmq.results. The topics must exist first
    (the relay sends an event for a missing topic to calmq.dlq). The row keeps the name
    without the environment's prefix (calmq.topics.logical_topic), as the outbox's routes
    do: the relay puts it back in front as it publishes."""
    stored = topics.logical_topic(topic) if topic else None
    with psycopg.connect(database_url) as conn:
        row = conn.execute(sql.queries()["set_results_topic"],
                           {"name": tenant, "topic": stored}).fetchone()
    if row is None:
        raise NotFound(f"no tenant named {tenant!r}", code="unknown_tenant")


def results_topics(database_url: str) -> dict[str, str | None]:
    """Every tenant's name and its own results topic in Kafka (None: the shared one)."""
    with psycopg.connect(database_url) as conn:
        rows = conn.execute(sql.queries()["results_topics"]).fetchall()
    return {str(name): topics.NAME_PREFIX + topic if topic else None for name, topic in rows}
