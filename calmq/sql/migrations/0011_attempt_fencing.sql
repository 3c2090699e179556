-- Attempt fencing (issue 15): every claim of a job gets a new lease_version, the fencing
-- token that each write of that attempt checks (heartbeat, step output, side-effect log,
-- finish). An attempt whose lease was taken over -- by another worker, or by the same
-- worker id after a restart -- holds an older version and can write nothing any more.
-- Unlike attempt (reset to 0 for each step, and by a redrive) it only ever grows.
ALTER TABLE jobs ADD COLUMN lease_version bigint NOT NULL DEFAULT 0;
-- Which claim each attempt was: artifacts are keyed by it, so a purge finds every one an
-- attempt may have written (also a stale attempt's, which no job row points at).
ALTER TABLE job_attempts ADD COLUMN lease_version bigint;
