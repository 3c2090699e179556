-- Database work per job (issue 21): every history event and attempt row checked its
-- foreign key to jobs (SELECT 1 FROM jobs ... FOR KEY SHARE: an index probe and a row lock
-- per row), four of the five such checks a job costs (queued, running and completed events,
-- the attempt; the fifth is the job's own check of its tenant, kept). pg_stat_statements
-- put them at 6-8 % of PostgreSQL's statement time per job (e2e, 2026-12-02).
--
-- They guard nothing calmq can get wrong: each of these rows is written by a statement
-- that inserts or locks (FOR UPDATE) its job row first, in the same transaction, or (the
-- batch lane's `batched` event) takes its job id from batch_jobs, whose own key to jobs
-- stays; so the job exists when the row is written. And calmq never deletes a job row
-- (DELETE /v1/jobs/{id} and the retention sweep redact it and keep its history). What went with the keys is
-- ON DELETE CASCADE: a job row deleted by hand leaves its events and attempts behind, to be
-- deleted by hand too (docs/explanation/decisions.md).
ALTER TABLE job_events DROP CONSTRAINT IF EXISTS job_events_job_id_fkey;
ALTER TABLE job_attempts DROP CONSTRAINT IF EXISTS job_attempts_job_id_fkey;
