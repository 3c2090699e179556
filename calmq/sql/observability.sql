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
