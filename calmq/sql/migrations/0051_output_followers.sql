-- Who follows a job's streamed text now (issue 42): one row per open event stream of an
-- API process (GET /v1/jobs/{id}/events), refreshed while it lasts and deleted when it
-- ends; a row whose process died goes once it expires. A worker announces a job's chunks
-- (NOTIFY calmq_job_output, calmq/sql/outputs.sql) only while a row for the job lives, so
-- text nobody watches fills neither the notification queue nor every API process's loop.
CREATE TABLE IF NOT EXISTS job_followers (
    job_id     uuid NOT NULL,
    follower   uuid NOT NULL,          -- the stream (a random id per GET)
    expires_at timestamptz NOT NULL,
    PRIMARY KEY (job_id, follower)
);
CREATE INDEX IF NOT EXISTS job_followers_expiry ON job_followers (expires_at);
