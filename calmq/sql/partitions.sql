-- The time partitions of job_events and job_attempts (calmq/data/partitions.py, migration
-- 0032): made ahead by the housekeeping, dropped whole by retention.

-- name: history_lock_timeout
-- How long the housekeeping waits for a lock on a history table before it gives the pass up
-- (the next pass tries again): never queue the fleet's reads and writes behind it longer.
SET LOCAL lock_timeout = '2s';

-- name: history_partitions_make
-- The partitions ending within the next %(ahead_seconds)s, each %(width_seconds)s wide, after
-- the newest one there is; a lock held longer than lock_timeout by someone else makes the
-- pass give up (calmq.data.partitions retries it at the next pass).
SELECT calmq_history_partitions(make_interval(secs => %(ahead_seconds)s),
                                make_interval(secs => %(width_seconds)s)) AS made;

-- name: history_partitions
-- Every partition of the history tables with its bounds (lower NULL: from MINVALUE, the
-- table as it was before 0032), whether a DETACH ... CONCURRENTLY of it was left half done,
-- its size on disk and the planner's row estimate.
SELECT i.inhparent::regclass::text AS parent, c.relname::text AS name,
       (regexp_match(b.bound, 'FROM \(''([^'']+)''\)'))[1]::timestamptz AS lower,
       (regexp_match(b.bound, 'TO \(''([^'']+)''\)'))[1]::timestamptz AS upper,
       i.inhdetachpending AS detach_pending,
       pg_total_relation_size(c.oid) AS bytes,
       greatest(c.reltuples, 0)::bigint AS rows_estimate
FROM pg_inherits i
JOIN pg_class c ON c.oid = i.inhrelid
CROSS JOIN LATERAL (SELECT pg_get_expr(c.relpartbound, c.oid) AS bound) b
WHERE i.inhparent IN ('job_events'::regclass, 'job_attempts'::regclass)
ORDER BY 1, 4;

-- name: history_horizon
-- The time before which no history row belongs to a job that still needs it: the oldest
-- creation time of any job that is not terminal, or terminal and not yet redacted, and never
-- later than the retention ago. Every row of job_events and job_attempts is written at or
-- after its job's creation, so a partition that ends at or before the horizon holds only the
-- history of jobs past retention (redacted, which only a terminal job is): it may go whole.
-- Each part is one index probe or a walk of a small partial index (the jobs that are not
-- terminal), never a scan of the table.
SELECT LEAST(
    now() - make_interval(secs => %(retention_seconds)s),
    (SELECT min(created_at) FROM jobs
     WHERE redacted_at IS NULL AND status IN ('completed', 'dead_letter', 'cancelled')),
    (SELECT min(created_at) FROM jobs WHERE status IN ('queued', 'retrying')),
    (SELECT min(created_at) FROM jobs WHERE status = 'running'),
    (SELECT min(created_at) FROM jobs WHERE status = 'awaiting_review')) AS horizon;

-- name: history_partition_expire
-- A partition past the retention that the horizon still holds back (some job created in it
-- is live, or ended within the retention): up to %(limit)s of its rows whose job is past
-- retention (redacted) are deleted, so one tenant's old open job never keeps every other
-- tenant's history. The kept jobs are few (the live and recently ended ones of that time),
-- each checked by one probe of jobs' primary key; the partition itself goes whole once the
-- horizon passes it. Identifiers filled in by calmq.data.partitions (psycopg.sql).
DELETE FROM {partition}
WHERE ctid = ANY(ARRAY(
    SELECT h.ctid FROM {partition} h
    WHERE NOT EXISTS (SELECT 1 FROM jobs j WHERE j.id = h.job_id AND j.redacted_at IS NULL)
    LIMIT %(limit)s))

-- The three statements that retire a partition, with identifiers filled in by
-- calmq.data.partitions (psycopg.sql). DETACH ... CONCURRENTLY takes SHARE UPDATE EXCLUSIVE:
-- reads and writes of the history go on while it waits for the transactions that may still
-- use the partition. It cannot run in a transaction block; one interrupted half way leaves the
-- partition "detach pending", which FINALIZE completes.

-- name: history_partition_detach
ALTER TABLE {parent} DETACH PARTITION {partition} CONCURRENTLY

-- name: history_partition_finalize
ALTER TABLE {parent} DETACH PARTITION {partition} FINALIZE

-- name: history_partition_drop
DROP TABLE IF EXISTS {partition}
