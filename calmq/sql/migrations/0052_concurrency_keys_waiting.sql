-- calmq: no-transaction
-- Jobs that wait behind their tenant's concurrency keys (issue 42: waiting_reason
-- concurrency_keys_waiting, past concurrency_keys_waiting_max keys waiting). The release
-- pass looks for them five times a second; without an index of their own it read every
-- waiting job of every reason (jobs_waiting_reason) each time. Few rows: only those jobs,
-- while they wait (a cancel leaves the reason on the row).
-- Built CONCURRENTLY (hence the first line): jobs may hold months of rows.
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_keys_waiting ON jobs (tenant_id, created_at)
    WHERE waiting_reason = 'concurrency_keys_waiting' AND status IN ('queued', 'retrying');
