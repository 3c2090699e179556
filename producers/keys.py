"""Tenant key management behind `calmq tenants add-key|revoke-key|webhook-secret`.

Revocation commits ``revoked_at`` and sends ``NOTIFY calmq_api_keys`` in the same
transaction; every API process drops its auth cache on that notification, so a revoked
key answers 401 at once. Should the notification be missed (an API process between two
LISTEN connections), the cache entry still expires after ``auth_cache_seconds``.
"""

from __future__ import annotations

import uuid

import psycopg
from psycopg.rows import dict_row

from calmq import sql
from calmq.errors import NotFound
from calmq.store import hash_api_key, new_api_key

__all__ = ["add_key", "revoke_keys", "webhook_secret"]


def add_key(database_url: str, tenant: str) -> str:
    """A new API key for the tenant (returned once; only its hash is stored)."""
    key = new_api_key()
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        row = conn.execute(sql.queries()["api_add_tenant_key"], {
            "id": uuid.uuid4(), "name": tenant, "key_hash": hash_api_key(key),
            "key_prefix": key[:12]}).fetchone()
    if row is None:
        raise NotFound(f"no tenant named {tenant!r}", code="unknown_tenant")
    return key


def revoke_keys(database_url: str, tenant: str, key_prefix: str | None = None) -> list[str]:
    """Revoke the tenant's key with this prefix (its first 12 characters), or all of them."""
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        rows = conn.execute(sql.queries()["api_revoke_tenant_keys"], {
            "name": tenant, "key_prefix": key_prefix[:12] if key_prefix else None}).fetchall()
    return [str(r["key_prefix"]) for r in rows]


def webhook_secret(database_url: str, tenant: str) -> str:
    """The secret that signs the tenant's webhook callbacks."""
    with psycopg.connect(database_url, row_factory=dict_row) as conn:
        row = conn.execute(sql.queries()["api_tenant_webhook_secret"], {"name": tenant}).fetchone()
    if row is None:
        raise NotFound(f"no tenant named {tenant!r}", code="unknown_tenant")
    return str(row["webhook_secret"])
