-- calmq: no-transaction
-- Cooldowns and fallback across models (issue 31, calmq.fallback).
-- job_attempts.model: the model that served the attempt's last call (a step may fall back
-- from its first allowed model to another while the first cools down after a 429).
-- jobs.waiting_until: when a job that waits for a cooldown (waiting_reason model_cooldown:
-- every model its step allows was cooling, so no call was made and no attempt counted) is
-- re-published by the release pass. The index holds only such jobs; it is built
-- CONCURRENTLY (hence the first line): jobs may hold months of rows.
ALTER TABLE job_attempts ADD COLUMN IF NOT EXISTS model text;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS waiting_until timestamptz;
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_cooldown_waiting ON jobs (waiting_until)
    WHERE waiting_reason = 'model_cooldown';
