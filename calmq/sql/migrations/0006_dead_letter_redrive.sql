-- Dead-letter review and redrive (calmq/deadletters.py).

-- A redrive gives a job a fresh attempt budget, so its attempts are numbered from 1 again.
-- job_attempts is keyed (job_id, step, attempt) and the workers write to it with that key,
-- so the earlier round's rows move here, numbered by round, instead of being overwritten:
-- the evidence a person read before the redrive stays readable after it.
CREATE TABLE job_attempts_redriven (
    job_id   uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    round    integer NOT NULL,   -- 1: the attempts before the first redrive
    step     text NOT NULL,
    attempt  integer NOT NULL,
    -- The whole job_attempts row as it was: other migrations add columns to job_attempts
    -- (tokens, cost, ...), and the archive keeps them all without following each change.
    record   jsonb NOT NULL,
    PRIMARY KEY (job_id, round, step, attempt)
);

-- `calmq dlq list` and GET /v1/dead-letters read dead letters by the time they died; a
-- partial index keeps that cheap however many completed jobs the table holds.
CREATE INDEX jobs_dead_letters ON jobs (updated_at, id) WHERE status = 'dead_letter';
