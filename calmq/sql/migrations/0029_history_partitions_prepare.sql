-- Partitioned history (issue 32), step 1 of 4: mark where the old tables end.
--
-- job_events and job_attempts become tables partitioned by time (by `at` and `started_at`:
-- columns every writer already fills, so no statement that writes history changes), with
-- one partition per day made ahead by the housekeeping (calmq_history_partitions, 0032),
-- and retention drops whole partitions once every job with history in them is past
-- retention (calmq/data/partitions.py). The tables as they are become the first partition,
-- for every time before a cutover, without copying a row and without a long lock:
--
--   0029  a CHECK constraint "before the cutover" on each table, NOT VALID: no scan, a lock
--         held for milliseconds (lock_timeout: it gives up rather than queue everyone
--         behind a long transaction, and the migrator tries again);
--   0030  VALIDATE the constraints: a scan of each table under SHARE UPDATE EXCLUSIVE, which
--         lets every read and write go on;
--   0031  the indexes the partitions need, built CONCURRENTLY (no-transaction migration);
--   0032  the swap: each table renamed, a partitioned table of the old name made, the old
--         table ATTACHed as the partition FROM (MINVALUE) TO (cutover). The validated
--         constraint proves the bound, so ATTACH scans nothing: the lock lasts milliseconds.
--
-- The cutover is midnight UTC three days from now: a NOT VALID constraint is enforced on
-- new rows at once, so it must lie past the time 0030-0032 take (a release's `calmq migrate`
-- runs them back to back). The old partition holds the history until then too; it is
-- dropped whole like any other once the retention has passed it.
-- docs/how-to/production-checklist.md ("Migrations on a large database") says what to do
-- when the migration cannot finish before the cutover.
SET LOCAL lock_timeout = '5s';

DO $$
DECLARE
    cutover timestamptz := date_trunc('day', now(), 'UTC') + interval '3 days';
BEGIN
    EXECUTE format('ALTER TABLE job_events ADD CONSTRAINT job_events_before_partitions'
                   ' CHECK (at < %L) NOT VALID', cutover);
    EXECUTE format('ALTER TABLE job_attempts ADD CONSTRAINT job_attempts_before_partitions'
                   ' CHECK (started_at < %L) NOT VALID', cutover);
END $$;

-- Autovacuum of the hot tables (issue 32). The defaults vacuum a table once a fifth of it is
-- dead: with 20 M jobs that is 4 M dead row versions first, each claim and finish leaving one,
-- and every index of jobs (updates of jobs are not HOT: docs/explanation/database-at-scale.md)
-- bloated in step. At 2 % the jobs table is vacuumed every 400 k dead versions of 20 M (a few
-- minutes at 500 jobs/s), and the cost limit lets one vacuum finish before the next is due.
-- The outbox is a queue (every row inserted, published, deleted): vacuum it by a count of
-- dead rows, not a share of a table that is nearly empty.
ALTER TABLE jobs SET (autovacuum_vacuum_scale_factor = 0.02,
                      autovacuum_vacuum_threshold = 10000,
                      autovacuum_analyze_scale_factor = 0.02,
                      autovacuum_vacuum_insert_scale_factor = 0.05,
                      autovacuum_vacuum_cost_limit = 2000);
ALTER TABLE outbox SET (autovacuum_vacuum_scale_factor = 0.0,
                        autovacuum_vacuum_threshold = 5000,
                        autovacuum_vacuum_insert_scale_factor = 0.0,
                        autovacuum_vacuum_insert_threshold = 20000,
                        autovacuum_vacuum_cost_limit = 2000);
