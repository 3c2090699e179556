-- calmq: no-transaction
-- Rerun from a step (issue 43): a rerun is a new job that names the job it reruns, so the
-- job view and the history can point back at it, and the original's reruns can be found.
-- Partial index: only reruns carry the column (most jobs never are one), and it is built
-- CONCURRENTLY (hence the first line): jobs may hold months of rows.
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS rerun_of uuid;
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_rerun_of ON jobs (rerun_of)
    WHERE rerun_of IS NOT NULL;
