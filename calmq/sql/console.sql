-- The web console's reads (calmq/data/console.py). Every query takes %(tenant_id)s: a
-- tenant's key sees only its own rows; NULL (a platform key) sees every tenant's.

-- name: console_jobs
-- Newest first, with every filter optional (priority: interactive or bulk; lane: online
-- or batch, migration 0014; any other value matches nothing).
-- search: a job id (or its first characters) or a metadata value, exactly. Both arms are
-- index-backed (calmq.data.console.search_terms): the id prefix as a range of the primary
-- key, the value as a JSON path on the GIN index jobs_metadata (migration 0031), so a
-- search never reads a tenant's jobs one by one.
SELECT j.id, t.name AS tenant, j.workflow, j.status, j.priority, j.lane, j.pool, j.step,
       j.attempt, j.created_at, j.updated_at, j.metadata
FROM jobs j JOIN tenants t ON t.id = j.tenant_id
WHERE (%(tenant_id)s::uuid IS NULL OR j.tenant_id = %(tenant_id)s::uuid)
  AND (%(statuses)s::text[] IS NULL OR j.status = ANY(%(statuses)s::text[]))
  AND (%(workflow)s::text IS NULL OR j.workflow = %(workflow)s::text)
  AND (%(pool)s::text IS NULL OR j.pool = %(pool)s::text)
  AND (%(priority)s::text IS NULL OR j.priority = %(priority)s::text)
  AND (%(lane)s::text IS NULL OR j.lane = %(lane)s::text)
  AND (%(created_after)s::timestamptz IS NULL OR j.created_at >= %(created_after)s::timestamptz)
  AND (%(created_before)s::timestamptz IS NULL OR j.created_at < %(created_before)s::timestamptz)
  AND (%(search)s::text IS NULL
       OR (j.id >= %(id_low)s::uuid AND j.id <= %(id_high)s::uuid)
       OR j.metadata @? %(metadata_path)s::jsonpath)
ORDER BY j.created_at DESC, j.id DESC
LIMIT %(limit)s;

-- name: console_reviews
-- Jobs waiting for a person, oldest first: what the queue shows, never the input or the
-- output (a list reads no payloads; console_review reads one review's).
SELECT j.id, t.name AS tenant, j.tenant_id, j.workflow, j.step, j.pool,
       j.review_deadline_at, j.updated_at, j.created_at, o.confidence
FROM jobs j JOIN step_outputs o ON o.job_id = j.id AND o.step = j.step
     JOIN tenants t ON t.id = j.tenant_id
WHERE j.status = 'awaiting_review'
  AND (%(tenant_id)s::uuid IS NULL OR j.tenant_id = %(tenant_id)s::uuid)
ORDER BY j.updated_at, j.id
LIMIT %(limit)s;

-- name: console_review
-- One job waiting for a person, by id: the model's output (the form corrects it whole) and
-- at most %(preview)s characters of the input, pretty-printed.
SELECT j.id, t.name AS tenant, j.tenant_id, j.workflow, j.step, j.pool,
       j.review_deadline_at, j.updated_at, j.created_at,
       left(jsonb_pretty(j.input), %(preview)s) AS input_preview,
       octet_length(j.input::text) AS input_bytes, j.input_ref, o.output, o.confidence
FROM jobs j JOIN step_outputs o ON o.job_id = j.id AND o.step = j.step
     JOIN tenants t ON t.id = j.tenant_id
WHERE j.id = %(id)s AND j.status = 'awaiting_review'
  AND (%(tenant_id)s::uuid IS NULL OR j.tenant_id = %(tenant_id)s::uuid);

-- name: console_job
-- One job's page: its row without the payload (at most %(preview)s characters of the
-- input, pretty-printed, and its size).
SELECT j.id, t.name AS tenant, j.tenant_id, j.workflow, j.workflow_version, j.status,
       j.priority, j.lane, j.pool, j.step, j.attempt, j.max_attempts, j.created_at,
       j.updated_at, j.deadline_at, j.review_deadline_at, j.trace_parent, j.metadata,
       j.input_tokens, j.output_tokens, j.cost_usd, j.error, j.artifact, j.input_ref,
       left(jsonb_pretty(j.input), %(preview)s) AS input_preview,
       octet_length(j.input::text) AS input_bytes
FROM jobs j JOIN tenants t ON t.id = j.tenant_id
WHERE j.id = %(id)s AND (%(tenant_id)s::uuid IS NULL OR j.tenant_id = %(tenant_id)s::uuid);

-- name: console_job_input
-- The whole inline input: the download of it, not a page.
SELECT input FROM jobs
WHERE id = %(id)s AND (%(tenant_id)s::uuid IS NULL OR tenant_id = %(tenant_id)s::uuid);

-- name: console_job_events
-- A job's history after event %(after)s (0: all of it), oldest first.
SELECT id, type, at, attempt, detail FROM job_events
WHERE job_id = %(id)s AND at >= (SELECT k.created_at FROM jobs k WHERE k.id = %(id)s) AND id > %(after)s
ORDER BY id
LIMIT %(limit)s;

-- name: console_job_attempts
-- Every attempt of every round, as JSON rows: round 0 is the current one (job_attempts),
-- then the archived rounds, oldest first.
SELECT round, record FROM (
    SELECT 0 AS round, 1 AS ord, to_jsonb(a) - 'job_id' AS record, a.started_at
    FROM job_attempts a WHERE a.job_id = %(id)s AND a.started_at >= (SELECT k.created_at FROM jobs k WHERE k.id = %(id)s)
    UNION ALL
    SELECT round, 0 AS ord, record, (record->>'started_at')::timestamptz
    FROM job_attempts_redriven WHERE job_id = %(id)s
) a
ORDER BY ord, round, started_at
LIMIT %(limit)s;

-- name: console_backlog
-- Unfinished jobs per pool, priority, lane and status, and how long the oldest has waited in
-- it (the queue age of calmq_queue_age_seconds, for queued and retrying). One arm per
-- partial index (jobs_waiting, jobs_running, jobs_awaiting_review): a single `status IN`
-- of all four statuses implies none of their predicates, and PostgreSQL read all of jobs
-- for it (476 ms for the largest tenant at 1 M jobs).
SELECT pool, priority, lane, status, count(*) AS jobs,
       GREATEST(0, extract(epoch FROM now() - min(updated_at)))::float8 AS oldest_seconds
FROM (SELECT pool, priority, lane, status, updated_at FROM jobs
      WHERE status IN ('queued', 'retrying')
        AND (%(tenant_id)s::uuid IS NULL OR tenant_id = %(tenant_id)s::uuid)
      UNION ALL
      SELECT pool, priority, lane, status, updated_at FROM jobs
      WHERE status = 'running'
        AND (%(tenant_id)s::uuid IS NULL OR tenant_id = %(tenant_id)s::uuid)
      UNION ALL
      SELECT pool, priority, lane, status, updated_at FROM jobs
      WHERE status = 'awaiting_review'
        AND (%(tenant_id)s::uuid IS NULL OR tenant_id = %(tenant_id)s::uuid)) unfinished
GROUP BY 1, 2, 3, 4
ORDER BY 1, 2, 3, 4;

-- name: console_outcomes
-- Jobs finished per 5-minute bin of the last hour (the 12 bins up to now), by how they ended:
-- the history's completed and dead_lettered events (what calmq_jobs_completed_total
-- counts), kept per tenant and bin as they are written (finish_bins and the deltas not
-- folded into it yet, migration 0042).
SELECT bin, type, sum(jobs)::bigint AS jobs
FROM (SELECT bin, type, jobs FROM finish_bins
      WHERE bin >= date_bin('5 minutes', now(), 'epoch'::timestamptz) - interval '55 minutes'
        AND (%(tenant_id)s::uuid IS NULL OR tenant_id = %(tenant_id)s::uuid)
      UNION ALL
      SELECT bin, type, jobs FROM finish_bin_deltas
      WHERE bin >= date_bin('5 minutes', now(), 'epoch'::timestamptz) - interval '55 minutes'
        AND (%(tenant_id)s::uuid IS NULL OR tenant_id = %(tenant_id)s::uuid)) finished
GROUP BY 1, 2
HAVING sum(jobs) <> 0
ORDER BY 1;

-- name: console_spend
-- Tokens and cost per UTC hour of the 24 up to now (the attempts' usage, which the
-- calmq_tokens_total counters add up, kept per tenant and hour as it is written: spend_hours
-- and the deltas not folded into it yet, migration 0040), what of it went to attempts that
-- did not complete (retried), and what the jobs dead-lettered in the hour cost, every
-- attempt of theirs (finish_bins, migration 0042). Hours with none of these are left out.
SELECT hour, sum(tokens)::bigint AS tokens, sum(cost_usd)::float8 AS cost_usd,
       sum(retry_cost_usd)::float8 AS retry_cost_usd,
       sum(dead_letter_cost_usd)::float8 AS dead_letter_cost_usd
FROM (SELECT hour, tokens, cost_usd, retry_cost_usd, 0 AS dead_letter_cost_usd
      FROM spend_hours
      WHERE hour >= date_trunc('hour', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                    - interval '23 hours'
        AND (%(tenant_id)s::uuid IS NULL OR tenant_id = %(tenant_id)s::uuid)
      UNION ALL
      SELECT hour, tokens, cost_usd, retry_cost_usd, 0 FROM spend_hour_deltas
      WHERE hour >= date_trunc('hour', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                    - interval '23 hours'
        AND (%(tenant_id)s::uuid IS NULL OR tenant_id = %(tenant_id)s::uuid)
      UNION ALL
      SELECT date_trunc('hour', bin AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', 0, 0, 0, cost_usd
      FROM (SELECT bin, tenant_id, type, cost_usd FROM finish_bins
            UNION ALL
            SELECT bin, tenant_id, type, cost_usd FROM finish_bin_deltas) f
      WHERE type = 'dead_lettered'
        AND bin >= date_trunc('hour', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                   - interval '23 hours'
        AND (%(tenant_id)s::uuid IS NULL OR tenant_id = %(tenant_id)s::uuid)) spent
GROUP BY hour
HAVING sum(tokens) <> 0 OR sum(cost_usd) <> 0 OR sum(dead_letter_cost_usd) <> 0
ORDER BY hour;

-- name: console_budget
-- The fleet's token budget per provider and model (calmq.calls.budget), in tokens per minute.
SELECT provider, model, tokens_per_minute FROM budget_buckets ORDER BY 1, 2;

-- name: console_review_caps
SELECT pool, cap FROM review_caps ORDER BY pool;

-- name: console_set_review_cap
-- A cap of NULL removes the pool's cap.
WITH gone AS (
    DELETE FROM review_caps WHERE pool = %(pool)s AND %(cap)s::integer IS NULL
)
INSERT INTO review_caps (pool, cap, updated_by)
SELECT %(pool)s, %(cap)s::integer, %(by)s WHERE %(cap)s::integer IS NOT NULL
ON CONFLICT (pool) DO UPDATE SET cap = EXCLUDED.cap, updated_by = EXCLUDED.updated_by,
                                 updated_at = now();

-- name: console_last_event
-- The id of the job's newest history entry: the console's SSE resumes after it.
SELECT coalesce(max(id), 0) AS id FROM job_events
WHERE job_id = %(id)s AND at >= (SELECT k.created_at FROM jobs k WHERE k.id = %(id)s);
