-- calmq schema, version 33 (issue 33): a streamed step's text as the model writes it.
--
-- A worker writes a streamed attempt's text in chunks (about one per 50 ms per job,
-- group-committed across jobs) and announces each with NOTIFY calmq_job_output, so the API
-- replicas that hold a subscriber pass it on at once; the rows are what a client that
-- reconnects (Last-Event-ID), or an API that restarted, reads from. A stream is one
-- attempt of one step, named by the attempt's fencing token (jobs.lease_version at its
-- claim), so a later attempt's stream sorts after an earlier one's and a stale worker's
-- chunks never pass for the current ones.
--
-- No foreign key to jobs: chunks are written and read on the hot path, and a purge
-- deletes a job's rows (calmq.data.retention) as it deletes its outbox rows.
CREATE TABLE job_output_chunks (
    job_id    uuid NOT NULL,
    stream    bigint NOT NULL,      -- the attempt's fencing token
    seq       integer NOT NULL,     -- 1, 2, ... within the stream
    step      text NOT NULL,
    attempt   integer NOT NULL,
    "offset"  integer NOT NULL,     -- characters of the stream's text before this chunk
    text      text NOT NULL,
    at        timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, stream, seq)
);

-- Once a job is final its chunks are compacted: the last stream of each step becomes one
-- row here (the text a late reader receives whole), and the chunks are deleted.
CREATE TABLE job_outputs (
    job_id    uuid NOT NULL,
    step      text NOT NULL,
    stream    bigint NOT NULL,
    attempt   integer NOT NULL,
    chunks    integer NOT NULL,     -- the stream's last seq
    text      text NOT NULL,
    compacted_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, step)
);
