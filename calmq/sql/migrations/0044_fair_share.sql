-- calmq: no-transaction
-- Fair share inside a lane (issue 31), first part: a tenant's weight, and the index of the
-- waiting room. While a lane (pool and priority) is contended, a worker holds the new jobs
-- it cannot start now in queued with waiting_reason 'fair_share' (their messages are
-- acknowledged), and fills each slot that frees from these rows, the tenant furthest below
-- its weighted share first (calmq/sql/fairness.sql). The index is built CONCURRENTLY (hence
-- this file's first line): jobs may hold months of rows, and a plain CREATE INDEX would stop
-- every write while it reads them; it holds only the rows that wait, a few thousand at most.
ALTER TABLE tenants ADD COLUMN IF NOT EXISTS weight double precision NOT NULL DEFAULT 1
    CHECK (weight > 0 AND weight <= 1000);
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_fair_waiting
    ON jobs (pool, priority, tenant_id, created_at, id)
    WHERE waiting_reason = 'fair_share' AND status IN ('queued', 'retrying');
