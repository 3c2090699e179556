-- How attempts ended, a group at a time (calmq/data/attempts.py).

-- name: finish_attempts
-- Record how a group of attempts ended (with their model calls' tokens and cost), move the
-- jobs, write their history and their outbox events: ONE statement for the whole group
-- (its rows: a JSON array, see Finish.row in calmq/data/attempts.py), so the history trigger runs
-- once and the planner once, not once per job. Job rows are locked in id order, like claim
-- and heartbeat. The guard is the attempt's fencing token: a finish whose lease_version is
-- no longer the job's (a reaper, a cancel or a newer claim took the job, by another worker
-- or by the same worker id) is a no-op for that job. Returns the ids of the jobs it moved.
WITH input AS (
    -- Each row carries its job's created_at: the lower bound of its attempt's partitions.
    -- attempt_rows joins job_attempts to this CTE alone, so that bound is a parameter of
    -- the partitions' scan and prunes them at run time; compared with moved's created_at
    -- (a second relation) it was a join filter, and every finish probed the index of
    -- every day's partition of the retention (33 at 30 days: 1.0 ms of statement time per
    -- job at 3 M jobs, against 0.35 ms on an empty database).
    SELECT r.*, k.created_at
    FROM jsonb_to_recordset(%(rows)s::jsonb)
         AS r(job_id uuid, worker text, step text, attempt integer, lease_version bigint,
              status text,
              event_type text, outcome text, event_detail jsonb, artifact jsonb, error jsonb,
              next_step text, reset_attempt boolean, waiting_reason text, outbox jsonb,
              model_calls integer,
              input_tokens bigint, output_tokens bigint, cost_usd float8, model text,
              cached_input_tokens bigint, cache_write_tokens bigint, cache_saved_usd float8,
              ord bigint)
         JOIN jobs k ON k.id = r.job_id
), target AS (
    SELECT j.id FROM jobs j JOIN input i ON i.job_id = j.id
    WHERE j.lease_owner = i.worker AND j.status = 'running'
      AND j.lease_version = i.lease_version
    ORDER BY j.id
    FOR UPDATE OF j
), moved AS (
    UPDATE jobs j SET status = i.status,
                      artifact = COALESCE(i.artifact, j.artifact),
                      error = i.error,
                      errors = CASE WHEN i.error IS NULL THEN j.errors
                                    ELSE calmq_append_error(j.errors, i.error
                                         || jsonb_build_object('attempt', j.attempt),
                                         %(keep_errors)s) END,
                      lease_owner = NULL, lease_expires_at = NULL,
                      attempt = CASE WHEN i.reset_attempt THEN 0 ELSE j.attempt END,
                      step = COALESCE(i.next_step, j.step),
                      -- set: the job waits (a spawning step's parent: for its children)
                      waiting_reason = COALESCE(i.waiting_reason, j.waiting_reason),
                      input_tokens = j.input_tokens + i.input_tokens,
                      output_tokens = j.output_tokens + i.output_tokens,
                      cost_usd = j.cost_usd + i.cost_usd,
                      cached_input_tokens = j.cached_input_tokens
                                            + COALESCE(i.cached_input_tokens, 0),
                      cache_write_tokens = j.cache_write_tokens
                                           + COALESCE(i.cache_write_tokens, 0),
                      cache_saved_usd = j.cache_saved_usd + COALESCE(i.cache_saved_usd, 0),
                      updated_at = now()
    FROM target t, input i
    WHERE j.id = t.id AND i.job_id = t.id
    RETURNING j.id, j.errors, j.input_tokens, j.output_tokens, j.cost_usd, j.parent_id,
              j.status, j.workflow, j.tenant_id
), attempt_rows AS (
    UPDATE job_attempts a SET finished_at = now(), outcome = i.outcome,
                              error_code = i.error ->> 'code',
                              error_class = i.error ->> 'class',
                              error_message = i.error ->> 'message',
                              model_calls = a.model_calls + i.model_calls,
                              input_tokens = a.input_tokens + i.input_tokens,
                              output_tokens = a.output_tokens + i.output_tokens,
                              cost_usd = a.cost_usd + i.cost_usd,
                              cached_input_tokens = a.cached_input_tokens
                                                    + COALESCE(i.cached_input_tokens, 0),
                              cache_write_tokens = a.cache_write_tokens
                                                   + COALESCE(i.cache_write_tokens, 0),
                              cache_saved_usd = a.cache_saved_usd
                                                + COALESCE(i.cache_saved_usd, 0),
                              model = COALESCE(i.model, a.model)
    FROM input i JOIN moved m ON m.id = i.job_id
    -- the attempt's partitions: from its job's creation on (jobs.sql, job_events)
    WHERE a.job_id = i.job_id AND a.step = i.step AND a.attempt = i.attempt
      AND a.started_at >= i.created_at
), events AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT i.job_id, i.event_type, i.attempt, i.event_detail
    FROM input i JOIN moved m ON m.id = i.job_id
    ORDER BY i.ord
), emitted AS (
    -- A terminal event carries the job's usage totals as this statement has just written them
    -- (the event was built before this attempt's tokens were added); a dead letter also every
    -- attempt's error.
    INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers)
    SELECT e.id, e.route, m.id::text, e.type,
           CASE WHEN e.type IN ('job.result', 'job.dead_lettered')
                THEN e.payload
                     || jsonb_build_object('usage', jsonb_build_object(
                            'input_tokens', m.input_tokens, 'output_tokens', m.output_tokens,
                            'cost_usd', m.cost_usd,
                            'lane', COALESCE(e.payload #>> '{usage,lane}', 'online'))
                         -- a result names the model that served its last call (fallback)
                         || CASE WHEN e.type = 'job.result'
                                 THEN jsonb_build_object('model', i.model)
                                 ELSE '{}'::jsonb END)
                     || CASE WHEN e.type = 'job.dead_lettered'
                             THEN jsonb_build_object('errors', m.errors) ELSE '{}'::jsonb END
                     -- a child job's names its parent (calmq.data.children)
                     || CASE WHEN m.parent_id IS NOT NULL
                             THEN jsonb_build_object('parent_id', m.parent_id::text)
                             ELSE '{}'::jsonb END
                ELSE e.payload END,
           e.headers
    FROM input i JOIN moved m ON m.id = i.job_id,
         jsonb_to_recordset(i.outbox)
             AS e(id uuid, route text, type text, payload jsonb, headers jsonb, n integer)
    ORDER BY i.ord, e.n
)
-- The jobs moved; those completed with their whole cost (calmq.job_costs: cost per accepted
-- job).
SELECT id, status, workflow, tenant_id, cost_usd FROM moved;
