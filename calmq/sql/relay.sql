-- Queries of the outbox relay's CDC mode (relay/cdc.py). The polling relay's own queries
-- (outbox_page, relay_cursor, save_relay_cursor, prune_outbox) are in outbox.sql.

-- name: relay_wal_level
SELECT current_setting('wal_level') AS wal_level;

-- name: relay_publication_exists
SELECT 1 FROM pg_publication WHERE pubname = %(publication)s;

-- name: relay_slot
SELECT s.slot_name, s.active, s.active_pid, s.confirmed_flush_lsn::text AS confirmed_flush_lsn,
       m.slot_name IS NOT NULL AS ours, m.caught_up_at IS NOT NULL AS caught_up
FROM pg_replication_slots s
LEFT JOIN relay_slots m ON m.slot_name = s.slot_name
WHERE s.slot_name = %(slot)s AND s.database = current_database();

-- name: relay_slot_record
-- What the relay remembers of a slot it made, whether or not the server still has it.
SELECT slot_name, caught_up_at IS NOT NULL AS caught_up, caught_up_at::text AS caught_up_at
FROM relay_slots WHERE slot_name = %(slot)s;

-- name: relay_server_version
SELECT current_setting('server_version_num')::int AS version;

-- name: relay_slot_failover
-- PostgreSQL 17+: whether a standby may synchronise the slot (failover = true).
SELECT failover FROM pg_replication_slots
WHERE slot_name = %(slot)s AND database = current_database();

-- name: relay_slot_lag
-- lag_bytes: WAL written since the last confirmed transaction; retained_bytes: WAL the
-- server keeps for the slot (what fills the disk when the relay stops).
SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn)::bigint AS lag_bytes,
       pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn)::bigint AS retained_bytes,
       pg_wal_lsn_diff(confirmed_flush_lsn, '0/0')::bigint AS confirmed_lsn
FROM pg_replication_slots WHERE slot_name = %(slot)s;

-- name: relay_horizon
-- Every transaction below the snapshot's xmin has ended, so its commit record lies before
-- the WAL insert position read after it: once the slot confirmed that position, all of
-- those transactions were published.
SELECT pg_snapshot_xmin(pg_current_snapshot())::text AS xmin,
       pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint AS lsn;

-- name: relay_prune_published
-- One batch of published rows, oldest first along the primary key.
DELETE FROM outbox
WHERE (txid, seq) IN (
    SELECT txid, seq FROM outbox WHERE txid < %(xmin)s::text::xid8
    ORDER BY txid, seq LIMIT %(limit)s
);

-- name: relay_snapshot_rows
-- Rows committed before the slot existed that the polling relay has not published.
SELECT seq, id, aggregatetype, aggregateid, type, payload, headers, txid::text AS txid
FROM outbox
WHERE (txid, seq) > (%(txid)s::text::xid8, %(seq)s)
ORDER BY txid, seq;

-- name: relay_mark_pending
INSERT INTO relay_slots (slot_name) VALUES (%(slot)s)
ON CONFLICT (slot_name) DO UPDATE
SET consistent_lsn = NULL, created_at = now(), caught_up_at = NULL;

-- name: relay_mark_caught_up
INSERT INTO relay_slots (slot_name, consistent_lsn, caught_up_at)
VALUES (%(slot)s, %(lsn)s::pg_lsn, now())
ON CONFLICT (slot_name) DO UPDATE
SET consistent_lsn = EXCLUDED.consistent_lsn, caught_up_at = now();

-- name: relay_forget_slot
DELETE FROM relay_slots WHERE slot_name = %(slot)s;
