-- Queries of the metrics samplers (producers/backlog.py, docs/reference/metrics.md).

-- name: obs_queue_age
-- The oldest waiting job (queued or retrying) per pool and priority, as seconds since it
-- started waiting (updated_at: set when it was queued, requeued or scheduled for retry).
-- A loose index scan over jobs_waiting: one probe per distinct (pool, priority) pair and one
-- per pair's oldest row, so the cost follows the number of pairs, not the backlog.
WITH RECURSIVE pairs AS (
    (SELECT pool, priority FROM jobs
     WHERE status IN ('queued', 'retrying')
     ORDER BY pool, priority LIMIT 1)
    UNION ALL
    SELECT n.pool, n.priority
    FROM pairs p CROSS JOIN LATERAL (
        SELECT pool, priority FROM jobs
        WHERE status IN ('queued', 'retrying') AND (pool, priority) > (p.pool, p.priority)
        ORDER BY pool, priority LIMIT 1
    ) n
)
SELECT p.pool, p.priority,
       GREATEST(0, extract(epoch FROM now() - o.oldest))::float8 AS age_seconds
FROM pairs p CROSS JOIN LATERAL (
    SELECT updated_at AS oldest FROM jobs
    WHERE status IN ('queued', 'retrying') AND pool = p.pool AND priority = p.priority
    ORDER BY updated_at LIMIT 1
) o;

-- name: obs_replication_slots
-- Every replication slot of this database (the relay's, an abandoned one, another tool's):
-- how much WAL the server keeps for it and whether a process streams from it. Read from
-- PostgreSQL rather than from the relay, so an abandoned slot, whose relay is gone, still
-- shows its retained WAL growing. pg_current_wal_lsn() fails on a standby, where the last
-- received position stands in. A slot that never reserved WAL (restart_lsn NULL) keeps none.
SELECT s.slot_name AS slot,
       s.active,
       COALESCE(pg_wal_lsn_diff(
           CASE WHEN pg_is_in_recovery() THEN pg_last_wal_receive_lsn()
                ELSE pg_current_wal_lsn() END,
           s.restart_lsn), 0)::bigint AS retained_bytes
FROM pg_replication_slots s
WHERE s.database = current_database()
ORDER BY s.slot_name;

-- name: obs_table_health
-- Dead and live tuples of each of calmq's tables (those of the schema it runs in), a
-- partitioned table's partitions summed under its name (pg_partition_root), with the time
-- since the last (auto)vacuum of any of its parts. The cumulative statistics' estimates: no
-- table is read, so the sample costs the same at 20 M jobs as at none.
SELECT root.relname AS "table",
       sum(s.n_live_tup)::bigint AS live,
       sum(s.n_dead_tup)::bigint AS dead,
       extract(epoch FROM now() - max(GREATEST(s.last_autovacuum, s.last_vacuum)))::float8
           AS since_vacuum_seconds
FROM pg_stat_user_tables s
JOIN pg_class root ON root.oid = COALESCE(pg_partition_root(s.relid), s.relid)
WHERE s.schemaname = current_schema()
GROUP BY root.relname
ORDER BY root.relname;

-- name: obs_transaction_ages
-- How close the database is to transaction ID wraparound (age of its oldest unfrozen XID;
-- PostgreSQL stops taking writes at about 2^31 - 3 million) and how long the oldest open
-- transaction has run: an old snapshot keeps every dead tuple since it began, so vacuum
-- frees nothing and bloat grows while it lasts. A replication slot's xmin does the same;
-- its age counts too. And the share of the server's NOTIFY queue (8 GB by default) in use:
-- notifications wait there until every listening session has read them, so one session
-- that stopped reading (or a transaction holding it) fills it, and at full every NOTIFY,
-- so every commit that sends one, fails.
SELECT (SELECT age(datfrozenxid) FROM pg_database
        WHERE datname = current_database())::bigint AS xid_age,
       COALESCE((SELECT extract(epoch FROM now() - min(xact_start)) FROM pg_stat_activity
                 WHERE datname = current_database() AND xact_start IS NOT NULL
                   AND backend_type = 'client backend'), 0)::float8
           AS oldest_transaction_seconds,
       COALESCE((SELECT max(age(xmin)) FROM pg_replication_slots
                 WHERE database = current_database() AND xmin IS NOT NULL), 0)::bigint
           AS slot_xmin_age,
       pg_notification_queue_usage()::float8 AS notification_queue_usage;
