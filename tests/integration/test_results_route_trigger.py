"""The outbox's results route (migrations 0056 and 0060): looked up per row once some tenant
has a results topic, once per transaction while none has, and looked up again in a
transaction that gives a tenant one. A database of its own: no other test's tenant topics."""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from calmq.data.migrations import migrate

pytestmark = pytest.mark.integration


def _tenant(conn: psycopg.Connection[Any], topic: str | None = None) -> str:
    row = conn.execute("INSERT INTO tenants (id, name, results_topic) VALUES "
                       "(gen_random_uuid(), %s, %s) RETURNING id::text",
                       (f"route-{uuid.uuid4().hex[:8]}", topic)).fetchone()
    assert row is not None
    return str(row[0])


def _emit(conn: psycopg.Connection[Any], tenant: str, route: str = "results") -> str:
    """The route the outbox row of a result for ``tenant`` was written with."""
    row = conn.execute(
        "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload) VALUES "
        "(gen_random_uuid(), %s, %s, 'job.result', jsonb_build_object('tenant_id', %s::text)) "
        "RETURNING aggregatetype", (route, str(uuid.uuid4()), tenant)).fetchone()
    assert row is not None
    return str(row[0])


def _said(conn: psycopg.Connection[Any]) -> str | None:
    row = conn.execute("SELECT current_setting('calmq.results_topics', true)").fetchone()
    return None if row is None else row[0]


def test_no_topic_is_looked_up_once_a_transaction_and_a_new_topic_routes_at_once(
        fresh_db: str) -> None:
    """With no tenant's topic, a transaction's results stay shared and the trigger says
    'none' once; a topic set in that same transaction routes its later rows there, and a
    later transaction routes results and dead letters by it; a tenant without one stays
    shared beside it."""
    migrate(fresh_db)
    with psycopg.connect(fresh_db) as conn:
        plain, other = _tenant(conn), _tenant(conn)
        conn.commit()
        assert [_emit(conn, plain), _emit(conn, other)] == ["results", "results"]
        assert _said(conn) == "none"
        conn.execute("UPDATE tenants SET results_topic = 'calmq.results.other' WHERE id = %s",
                     (other,))
        assert _emit(conn, other) == "results.other"
        assert _emit(conn, plain) == "results"
        conn.commit()
        assert _said(conn) in (None, "")  # transaction-local: gone with the commit
        assert _emit(conn, other, "dlq") == "results.other.dlq"
        assert _emit(conn, plain, "dlq") == "dlq"
        assert _said(conn) == "some"
        conn.commit()
        conn.execute("UPDATE tenants SET results_topic = NULL WHERE id = %s", (other,))
        conn.commit()
        assert _emit(conn, other) == "results"
        assert _said(conn) == "none"
        conn.rollback()
