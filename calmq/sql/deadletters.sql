-- Dead letters (calmq/data/deadletters.py): review and redrive. Names start with dlq_.

-- name: dlq_list
-- Dead-lettered jobs, oldest death first; every filter is optional (NULL: no filter).
SELECT j.id, j.tenant_id, t.name AS tenant, j.workflow, j.workflow_version, j.priority,
       j.pool, j.step, j.attempt, j.error, j.created_at, j.updated_at AS dead_lettered_at
FROM jobs j JOIN tenants t ON t.id = j.tenant_id
WHERE j.status = 'dead_letter'
  AND (%(tenant_id)s::uuid IS NULL OR j.tenant_id = %(tenant_id)s::uuid)
  AND (%(tenant)s::text IS NULL OR t.name = %(tenant)s::text)
  AND (%(failure_class)s::text IS NULL OR j.error->>'class' = %(failure_class)s::text)
  AND (%(code)s::text IS NULL OR j.error->>'code' = %(code)s::text)
  AND (%(workflow)s::text IS NULL OR j.workflow = %(workflow)s::text)
  AND (%(since)s::timestamptz IS NULL OR j.updated_at >= %(since)s::timestamptz)
  AND (%(until)s::timestamptz IS NULL OR j.updated_at < %(until)s::timestamptz)
  -- keyset: after the (dead_lettered_at, id) of the previous page's last row, so a bulk
  -- redrive pages through any number of dead letters without OFFSET (jobs_dead_letters)
  AND (%(after_at)s::timestamptz IS NULL
       OR (j.updated_at, j.id) > (%(after_at)s::timestamptz, %(after_id)s::uuid))
ORDER BY j.updated_at, j.id
LIMIT %(limit)s;

-- name: dlq_count
-- How many dead letters dlq_list would page through (the same filters and keyset).
SELECT count(*) AS n
FROM jobs j JOIN tenants t ON t.id = j.tenant_id
WHERE j.status = 'dead_letter'
  AND (%(tenant_id)s::uuid IS NULL OR j.tenant_id = %(tenant_id)s::uuid)
  AND (%(tenant)s::text IS NULL OR t.name = %(tenant)s::text)
  AND (%(failure_class)s::text IS NULL OR j.error->>'class' = %(failure_class)s::text)
  AND (%(code)s::text IS NULL OR j.error->>'code' = %(code)s::text)
  AND (%(workflow)s::text IS NULL OR j.workflow = %(workflow)s::text)
  AND (%(since)s::timestamptz IS NULL OR j.updated_at >= %(since)s::timestamptz)
  AND (%(until)s::timestamptz IS NULL OR j.updated_at < %(until)s::timestamptz)
  AND (%(after_at)s::timestamptz IS NULL
       OR (j.updated_at, j.id) > (%(after_at)s::timestamptz, %(after_id)s::uuid));

-- name: dlq_summary
-- Dead letters grouped by where and why they died, largest group first (dlq_list's filters).
SELECT j.workflow, j.step, j.error->>'class' AS failure_class, j.error->>'code' AS code,
       count(*) AS count, min(j.updated_at) AS oldest, max(j.updated_at) AS newest
FROM jobs j JOIN tenants t ON t.id = j.tenant_id
WHERE j.status = 'dead_letter'
  AND (%(tenant_id)s::uuid IS NULL OR j.tenant_id = %(tenant_id)s::uuid)
  AND (%(tenant)s::text IS NULL OR t.name = %(tenant)s::text)
  AND (%(failure_class)s::text IS NULL OR j.error->>'class' = %(failure_class)s::text)
  AND (%(code)s::text IS NULL OR j.error->>'code' = %(code)s::text)
  AND (%(workflow)s::text IS NULL OR j.workflow = %(workflow)s::text)
  AND (%(since)s::timestamptz IS NULL OR j.updated_at >= %(since)s::timestamptz)
  AND (%(until)s::timestamptz IS NULL OR j.updated_at < %(until)s::timestamptz)
GROUP BY 1, 2, 3, 4
ORDER BY count(*) DESC, 1, 2, 3, 4;

-- name: dlq_job
-- The whole job row, for any status (show explains why a job is not a dead letter).
SELECT j.*, t.name AS tenant
FROM jobs j JOIN tenants t ON t.id = j.tenant_id
WHERE j.id = %(id)s AND (%(tenant_id)s::uuid IS NULL OR j.tenant_id = %(tenant_id)s::uuid);

-- name: dlq_attempts
-- Every attempt of every round, as JSON rows: round 0 is the current one (job_attempts),
-- then the archived rounds, oldest first.
SELECT round, record FROM (
    SELECT 0 AS round, 1 AS ord, to_jsonb(a) - 'job_id' AS record, a.started_at
    FROM job_attempts a WHERE a.job_id = %(id)s AND a.started_at >= (SELECT k.created_at FROM jobs k WHERE k.id = %(id)s)
    UNION ALL
    SELECT round, 0 AS ord, record, (record->>'started_at')::timestamptz
    FROM job_attempts_redriven WHERE job_id = %(id)s
) a
ORDER BY ord, round, started_at;

-- name: dlq_events
SELECT type, at, attempt, detail FROM job_events
WHERE job_id = %(id)s AND at >= (SELECT k.created_at FROM jobs k WHERE k.id = %(id)s)
ORDER BY id;

-- name: dlq_requeue
-- The redrive itself, guarded by status: a job that is no longer a dead letter (redriven
-- by someone else a moment ago, or never dead) is left alone, so it is never duplicated.
WITH requeued AS (
    UPDATE jobs SET status = 'queued', attempt = 0, error = NULL,
                    lease_owner = NULL, lease_expires_at = NULL,
                    workflow_version = %(workflow_version)s, pool = %(pool)s,
                    max_attempts = %(max_attempts)s, updated_at = now()
    -- A purged (redacted) dead letter has no input left to run: never redriven.
    WHERE id = %(id)s AND status = 'dead_letter' AND redacted_at IS NULL
    -- The whole row: job.requested is filled from it by the Avro schema's field names, so a
    -- new job column reaches the event without an edit here.
    RETURNING *
), round AS (
    SELECT count(*) + 1 AS n FROM job_events
    WHERE job_id = %(id)s AND at >= (SELECT created_at FROM requeued)
      AND type = 'redriven'
), archived AS (
    DELETE FROM job_attempts a USING requeued r
    WHERE a.job_id = r.id AND a.started_at >= r.created_at
    RETURNING a.*
), kept AS (
    INSERT INTO job_attempts_redriven (job_id, round, step, attempt, record)
    SELECT a.job_id, (SELECT n FROM round), a.step, a.attempt, to_jsonb(a) - 'job_id'
    FROM archived a
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'redriven', 0, %(detail)s::jsonb || jsonb_build_object('round', (SELECT n FROM round))
    FROM requeued
)
SELECT r.*, (SELECT n FROM round) AS round FROM requeued r;
