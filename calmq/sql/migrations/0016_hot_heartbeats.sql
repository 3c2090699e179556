-- Database work per job (issue 21): a lease heartbeat rewrites only lease_expires_at, but
-- jobs_leased indexed exactly that column, so every heartbeat was a non-HOT update: a new
-- row version on another page and a new entry in every index of jobs (primary key,
-- jobs_tenant_created, jobs_leased). With long model calls (a 10 s call is heartbeated
-- every lease_seconds / 3) that was as many index writes per job as its claim and finish.
--
-- The lease sweep (reap_expired_leases, poison_expired_leases) and `calmq lag`
-- (ops_jobs_in_flight) need the running jobs, not the lease order: an index of running
-- jobs by (pool, priority), neither of which a heartbeat changes, serves both; the sweep
-- filters the running jobs' lease times (as many rows as jobs in flight, every third of a
-- lease per process). Heartbeats are then HOT when the row's page has room, which a
-- fillfactor of 90 keeps for updates of rows written from now on.
--
-- Claims and finishes stay non-HOT: they change status, which the partial indexes of the
-- waiting, review, dead-letter and retention queries select on (see BENCHMARKS.md's notes,
-- bench/results/notes/).
ALTER TABLE jobs SET (fillfactor = 90);
CREATE INDEX jobs_running ON jobs (pool, priority) WHERE status = 'running';
DROP INDEX jobs_leased;
