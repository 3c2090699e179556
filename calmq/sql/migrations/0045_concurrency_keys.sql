-- calmq: no-transaction
-- Concurrency keys (issue 31): a submit may name a key (a customer inside a tenant), and a
-- workflow may declare how many of one key's jobs run at once (Workflow.concurrency_limit).
-- key_admitted_at: when admission let the job through for its key; it counts against the
-- key from then until its claim (which clears it: a running job counts by its status), or
-- for a lease at most, so a job admitted and never claimed gives its place back by itself.
-- The index is built CONCURRENTLY (hence the first line): jobs may hold months of rows.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS concurrency_key text;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS key_admitted_at timestamptz;
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_concurrency_key ON jobs (tenant_id, concurrency_key)
    WHERE concurrency_key IS NOT NULL AND status IN ('queued', 'retrying', 'running');
