-- calmq: no-transaction
-- Partitioned history (issue 32), step 3 of 4 (0029 says the whole plan): the indexes that
-- the swap (0032) attaches to the partitioned tables' own, built without a lock that stops
-- writes (CONCURRENTLY cannot run in a transaction, hence this file's first line).
--
-- job_attempts: (job_id, step, attempt) without uniqueness. The primary key cannot stay the
-- partitioned table's (a unique index of a partitioned table must hold the partition key,
-- and started_at would make it unique for nothing); the old key stays on the old partition.
CREATE INDEX CONCURRENTLY IF NOT EXISTS job_attempts_by_job
    ON job_attempts (job_id, step, attempt);
-- job_events: a BRIN index of the event time. The console's charts read the last hour of
-- events; a BRIN index is a few pages per partition and, being a summary, costs an insert
-- nothing most of the time.
CREATE INDEX CONCURRENTLY IF NOT EXISTS job_events_at ON job_events USING brin (at);
-- Retention walks the jobs that still hold data by their creation time, oldest first, so
-- that the oldest one left is the first entry of the index: the horizon below which every
-- history partition may go (calmq/data/partitions.py). It replaces jobs_retention (by
-- updated_at), which served only the walk.
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_unredacted ON jobs (created_at)
    WHERE redacted_at IS NULL AND status IN ('completed', 'dead_letter', 'cancelled');
DROP INDEX CONCURRENTLY IF EXISTS jobs_retention;
-- A purge clears a job's webhook deliveries and idempotency keys by job id; without these
-- indexes each purge (and each retention batch) read both tables whole: they grow with every
-- callback and every keyed submit.
CREATE INDEX CONCURRENTLY IF NOT EXISTS webhook_deliveries_job ON webhook_deliveries (job_id);
CREATE INDEX CONCURRENTLY IF NOT EXISTS idempotency_keys_job ON idempotency_keys (job_id);
-- The console's job search (console.sql, console_jobs) finds a metadata value through this
-- index (a JSON path `$.* ? (@ == "value")`; the default jsonb_ops class, which indexes
-- values apart from their keys: jsonb_path_ops cannot serve a wildcard key), instead of
-- reading each of a tenant's jobs.
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_metadata ON jobs USING gin (metadata);
