-- Reruns from a step (calmq/data/reruns.py): a new job that starts at a step of a job that
-- ended, with the recorded outputs of the steps before it copied, so none is paid again.
-- Names start with rerun_.

-- name: rerun_original
-- The job a rerun starts from, and the steps it has a final recorded output of (the ones a
-- resumed job skips: calmq.workflows.progress), in one round trip; tenant-scoped when a
-- tenant asks (another tenant's id reads as no job).
SELECT id, tenant_id, workflow, workflow_version, status, priority, lane, input, input_ref,
       metadata, callback_url, deadline_at, created_at, trace_parent, concurrency_key,
       redacted_at,
       ARRAY(SELECT s.step FROM step_outputs s
             WHERE s.job_id = jobs.id AND s.state IN ('done', 'approved')) AS recorded
FROM jobs
WHERE id = %(id)s AND (%(tenant_id)s::uuid IS NULL OR tenant_id = %(tenant_id)s::uuid);

-- name: rerun_insert_job
-- insert_job's row, history event and outbox row (calmq/sql/jobs.sql), plus the link to
-- the original and its recorded outputs of the steps before the one the rerun starts at,
-- all in one statement: the job.requested commits with the outputs it will read. The
-- output of ``replaced_step`` (the step before ``step``) is the caller's replacement input
-- when one is given. The original is read FOR SHARE first (the tenant's, not redacted): a
-- concurrent purge (which redacts the row) waits for the rerun's commit, so the outputs
-- copied are the ones the job had; with no such row nothing is written (no row returned).
WITH original AS (
    SELECT id FROM jobs
    WHERE id = %(rerun_of)s AND tenant_id = %(tenant_id)s AND redacted_at IS NULL
    FOR SHARE
), job AS (
    INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority, pool, step,
                      max_attempts, input, input_ref, metadata, callback_url, deadline_at,
                      trace_parent, lane, concurrency_key, rerun_of)
    SELECT %(id)s, %(tenant_id)s, %(workflow)s, %(workflow_version)s, 'queued', %(priority)s,
           %(pool)s, %(step)s, %(max_attempts)s, %(input)s, %(input_ref)s, %(metadata)s,
           %(callback_url)s, %(deadline_at)s, %(trace_parent)s, %(lane)s,
           %(concurrency_key)s, original.id
    FROM original
    RETURNING id, created_at
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'queued', 0, %(detail)s FROM job
), copied AS (
    INSERT INTO step_outputs (job_id, step, state, output, model_output, confidence, reviewer,
                              reviewed_at)
    SELECT job.id, s.step, s.state,
           CASE WHEN s.step = %(replaced_step)s::text THEN %(replacement)s::jsonb
                ELSE s.output END,
           s.model_output, s.confidence, s.reviewer, s.reviewed_at
    FROM job, step_outputs s
    WHERE s.job_id = %(rerun_of)s AND s.step = ANY(%(copy_steps)s::text[])
      AND s.state IN ('done', 'approved')
)
INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers)
SELECT %(event_id)s, %(route)s, id::text, 'job.requested',
       %(payload)s::jsonb || jsonb_build_object(
           'created_at', floor(extract(epoch FROM created_at) * 1000)::bigint),
       %(headers)s
FROM job
RETURNING (SELECT created_at FROM job) AS created_at;

-- name: rerun_cost
-- What the original's attempts of the steps a rerun runs again cost (tokens and USD, every
-- attempt of them, the last redrive round's): the rerun's estimate.
SELECT coalesce(sum(a.cost_usd), 0)::float8 AS cost_usd,
       coalesce(sum(a.input_tokens + a.output_tokens), 0)::bigint AS tokens
FROM job_attempts a
WHERE a.job_id = %(id)s AND a.step = ANY(%(steps)s::text[])
  AND a.started_at >= (SELECT k.created_at FROM jobs k WHERE k.id = %(id)s);

-- fragment: rerun_match
-- Which jobs a bulk rerun takes (every tenant's: the CLI's operators): ended jobs of the
-- filter's workflow, statuses, failure code, tenant, metadata and creation times.
FROM jobs j JOIN tenants t ON t.id = j.tenant_id
WHERE j.workflow = %(workflow)s
  AND j.status = ANY(%(statuses)s::text[])
  AND (%(tenant)s::text IS NULL OR t.name = %(tenant)s::text)
  AND (%(code)s::text IS NULL OR j.error->>'code' = %(code)s::text)
  AND (%(metadata)s::jsonb IS NULL OR j.metadata @> %(metadata)s::jsonb)
  AND (%(created_after)s::timestamptz IS NULL OR j.created_at >= %(created_after)s::timestamptz)
  AND j.created_at < %(created_before)s::timestamptz
  AND j.redacted_at IS NULL
  AND (%(cursor_at)s::timestamptz IS NULL
       OR (j.created_at, j.id) < (%(cursor_at)s::timestamptz, %(cursor_id)s::uuid))

-- name: rerun_matches
-- A page of them, newest first after the (created_at, id) cursor (jobs_tenant_created's
-- order, as ops_list_jobs).
SELECT j.id, j.tenant_id, j.created_at
{{rerun_match}}
ORDER BY j.created_at DESC, j.id DESC
LIMIT %(limit)s;

-- name: rerun_match_estimate
-- How many match (from the cursor on), and what their attempts of the steps to run again
-- cost: the dry run's count and estimate, and the tokens the pacing divides the budget by.
WITH m AS (SELECT j.id, j.created_at {{rerun_match}})
SELECT (SELECT count(*) FROM m) AS n,
       coalesce(sum(a.cost_usd), 0)::float8 AS cost_usd,
       coalesce(sum(a.input_tokens + a.output_tokens), 0)::bigint AS tokens,
       count(a.*) AS calls
FROM m JOIN job_attempts a ON a.job_id = m.id AND a.started_at >= m.created_at
WHERE a.step = ANY(%(steps)s::text[]);

-- name: rerun_since
-- Whether the job has a rerun created at or after a time (a resumed bulk rerun skips a job
-- the interrupted run reran after its last checkpoint): the jobs_rerun_of index.
SELECT EXISTS (SELECT 1 FROM jobs WHERE rerun_of = %(id)s AND created_at >= %(since)s)
       AS found;

-- name: rerun_step_output
-- One recorded step output of the original (the step before the one a rerun starts at).
SELECT output FROM step_outputs WHERE job_id = %(id)s AND step = %(step)s;
