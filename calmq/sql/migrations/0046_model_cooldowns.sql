-- calmq: no-transaction
-- Cooldowns and fallback across models (issue 31, calmq.fallback).
-- job_attempts.model: the model that served the attempt's last call (a step may fall back
-- from its first allowed model to another while the first cools down after a 429).
-- jobs.waiting_until: when a job that waits a set time is re-published by the release pass:
-- every model its step allows was cooling (waiting_reason model_cooldown), or its
-- concurrency key was at its rate limit (rate_limit_key); no call was made and no attempt
-- counted. The index holds only such jobs; it is built CONCURRENTLY (hence the first
-- line): jobs may hold months of rows.
ALTER TABLE job_attempts ADD COLUMN IF NOT EXISTS model text;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS waiting_until timestamptz;
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_timed_waiting ON jobs (waiting_until)
    WHERE waiting_until IS NOT NULL;
