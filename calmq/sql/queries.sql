-- Named queries, loaded once by calmq/store.py. Each starts with "-- name: <name>".

-- name: create_tenant
INSERT INTO tenants (id, name) VALUES (%(id)s, %(name)s) RETURNING id, name, created_at;

-- name: create_api_key
INSERT INTO api_keys (id, tenant_id, key_hash, key_prefix)
VALUES (%(id)s, %(tenant_id)s, %(key_hash)s, %(key_prefix)s);

-- name: tenant_by_name
SELECT id, name, created_at FROM tenants WHERE name = %(name)s;

-- name: revoke_api_key
UPDATE api_keys SET revoked_at = now()
WHERE key_prefix = %(key_prefix)s AND revoked_at IS NULL RETURNING id;

-- name: tenant_for_key
SELECT t.id, t.name FROM api_keys k JOIN tenants t ON t.id = k.tenant_id
WHERE k.key_hash = %(key_hash)s AND k.revoked_at IS NULL;

-- name: find_idempotency_key
SELECT request_hash, job_id FROM idempotency_keys
WHERE tenant_id = %(tenant_id)s AND key = %(key)s;

-- name: insert_idempotency_key
INSERT INTO idempotency_keys (tenant_id, key, request_hash, job_id)
VALUES (%(tenant_id)s, %(key)s, %(request_hash)s, %(job_id)s);

-- name: insert_job
-- The job row, its first history event and its outbox row in one statement: one round trip.
WITH job AS (
    INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority, pool, step,
                      max_attempts, input, input_ref, metadata, callback_url, deadline_at,
                      trace_parent)
    VALUES (%(id)s, %(tenant_id)s, %(workflow)s, %(workflow_version)s, 'queued', %(priority)s,
            %(pool)s, %(step)s, %(max_attempts)s, %(input)s, %(input_ref)s, %(metadata)s,
            %(callback_url)s, %(deadline_at)s, %(trace_parent)s)
    RETURNING id, created_at
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'queued', 0, '{}'::jsonb FROM job
)
INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers)
SELECT %(event_id)s, %(route)s, id::text, 'job.requested',
       %(payload)s::jsonb || jsonb_build_object(
           'created_at', (extract(epoch FROM created_at) * 1000)::bigint),
       %(headers)s
FROM job
RETURNING (SELECT created_at FROM job) AS created_at;

-- name: job_for_tenant
SELECT id, tenant_id, workflow, workflow_version, status, priority, pool, step, attempt,
       max_attempts, artifact, error, created_at, updated_at,
       input_tokens, output_tokens, cost_usd
FROM jobs WHERE id = %(id)s AND tenant_id = %(tenant_id)s;

-- name: job_events
SELECT type, at, attempt, detail FROM job_events WHERE job_id = %(id)s ORDER BY id;

-- name: claim_jobs
-- Claim every job of a polled batch in one statement. A job is claimable when it is
-- waiting (queued, retrying) or running under an expired lease (its worker died; the
-- history then says requeued_after_restart before the new running event).
WITH target AS (
    SELECT id, status AS old_status FROM jobs
    WHERE id = ANY(%(ids)s)
      -- a message for a step the job has left behind is stale (multi-step workflows)
      AND (%(steps)s::jsonb IS NULL OR step = %(steps)s::jsonb ->> id::text)
      AND (status IN ('queued', 'retrying')
           OR (status = 'running' AND lease_expires_at < now()))
    ORDER BY id
    FOR UPDATE
), claimed AS (
    UPDATE jobs j SET status = 'running', attempt = j.attempt + 1,
                      lease_owner = %(worker)s,
                      lease_expires_at = now() + make_interval(secs => %(lease_seconds)s),
                      updated_at = now()
    FROM target t WHERE j.id = t.id
    RETURNING j.id, j.tenant_id, j.workflow, j.workflow_version, j.priority, j.pool, j.step,
              j.attempt, j.max_attempts, j.input, j.input_ref, j.metadata, j.deadline_at,
              j.trace_parent, j.created_at, t.old_status
), requeued AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'requeued_after_restart', attempt - 1, '{"reason": "lease_expired"}'::jsonb
    FROM claimed WHERE old_status = 'running'
), attempts AS (
    INSERT INTO job_attempts (job_id, step, attempt, worker, started_at)
    SELECT id, step, attempt, %(worker)s, now() FROM claimed
    ON CONFLICT (job_id, step, attempt) DO NOTHING
), running AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'running', attempt, jsonb_build_object('worker', %(worker)s::text) FROM claimed
)
SELECT * FROM claimed;

-- name: visible_jobs
-- Which of a batch's unclaimed jobs this session can see: step and status.
SELECT id, step, status FROM jobs WHERE id = ANY(%(ids)s);

-- name: heartbeat
-- Rows are locked in id order, the order claim and finish use too: concurrent heartbeats,
-- claims and group commits of one worker then never deadlock on each other.
WITH held AS (
    SELECT id FROM jobs
    WHERE id = ANY(%(ids)s) AND lease_owner = %(worker)s AND status = 'running'
    ORDER BY id
    FOR UPDATE
)
UPDATE jobs j SET lease_expires_at = now() + make_interval(secs => %(lease_seconds)s)
FROM held WHERE j.id = held.id
RETURNING j.id;

-- name: finish_attempts
-- Record how a group of attempts ended (with their model calls' tokens and cost), move the
-- jobs, write their history and their outbox events: ONE statement for the whole group
-- (its rows: a JSON array, see Finish.row in calmq/store.py), so the history trigger runs
-- once and the planner once, not once per job. Job rows are locked in id order, like claim
-- and heartbeat. The guard on lease_owner makes a late finish (after a reaper or a cancel
-- took the job) a no-op for that job.
WITH input AS (
    SELECT *
    FROM jsonb_to_recordset(%(rows)s::jsonb)
         AS r(job_id uuid, worker text, step text, attempt integer, status text,
              event_type text, outcome text, event_detail jsonb, artifact jsonb, error jsonb,
              next_step text, reset_attempt boolean, outbox jsonb, model_calls integer,
              input_tokens bigint, output_tokens bigint, cost_usd float8, ord bigint)
), target AS (
    SELECT j.id FROM jobs j JOIN input i ON i.job_id = j.id
    WHERE j.lease_owner = i.worker AND j.status = 'running'
    ORDER BY j.id
    FOR UPDATE OF j
), moved AS (
    UPDATE jobs j SET status = i.status,
                      artifact = COALESCE(i.artifact, j.artifact),
                      error = i.error,
                      errors = CASE WHEN i.error IS NULL THEN j.errors
                                    ELSE j.errors || jsonb_build_array(i.error
                                         || jsonb_build_object('attempt', j.attempt)) END,
                      lease_owner = NULL, lease_expires_at = NULL,
                      attempt = CASE WHEN i.reset_attempt THEN 0 ELSE j.attempt END,
                      step = COALESCE(i.next_step, j.step),
                      input_tokens = j.input_tokens + i.input_tokens,
                      output_tokens = j.output_tokens + i.output_tokens,
                      cost_usd = j.cost_usd + i.cost_usd,
                      updated_at = now()
    FROM target t, input i
    WHERE j.id = t.id AND i.job_id = t.id
    RETURNING j.id, j.errors
), attempt_rows AS (
    UPDATE job_attempts a SET finished_at = now(), outcome = i.outcome,
                              error_code = i.error ->> 'code',
                              error_class = i.error ->> 'class',
                              error_message = i.error ->> 'message',
                              model_calls = a.model_calls + i.model_calls,
                              input_tokens = a.input_tokens + i.input_tokens,
                              output_tokens = a.output_tokens + i.output_tokens,
                              cost_usd = a.cost_usd + i.cost_usd
    FROM input i JOIN moved m ON m.id = i.job_id
    WHERE a.job_id = i.job_id AND a.step = i.step AND a.attempt = i.attempt
), events AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT i.job_id, i.event_type, i.attempt, i.event_detail
    FROM input i JOIN moved m ON m.id = i.job_id
    ORDER BY i.ord
)
INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers)
SELECT e.id, e.route, m.id::text, e.type,
       CASE WHEN e.type = 'job.dead_lettered'
            THEN e.payload || jsonb_build_object('errors', m.errors) ELSE e.payload END,
       e.headers
FROM input i JOIN moved m ON m.id = i.job_id,
     jsonb_to_recordset(i.outbox)
         AS e(id uuid, route text, type text, payload jsonb, headers jsonb, n integer)
ORDER BY i.ord, e.n;

-- name: outbox_page
-- Rows of transactions that committed: every transaction below the snapshot's xmin has
-- ended, so no row can still appear behind the cursor (DESIGN.md §5).
SELECT seq, id, aggregatetype, aggregateid, type, payload, headers, txid::text AS txid
FROM outbox
WHERE (txid, seq) > (%(txid)s::text::xid8, %(seq)s)
  AND txid < pg_snapshot_xmin(pg_current_snapshot())
ORDER BY txid, seq
LIMIT %(limit)s;

-- name: relay_cursor
SELECT txid::text AS txid, seq FROM relay_cursor WHERE name = %(name)s;

-- name: save_relay_cursor
INSERT INTO relay_cursor (name, txid, seq) VALUES (%(name)s, %(txid)s::text::xid8, %(seq)s)
ON CONFLICT (name) DO UPDATE SET txid = EXCLUDED.txid, seq = EXCLUDED.seq, updated_at = now();

-- name: prune_outbox
DELETE FROM outbox
WHERE (txid, seq) <= (%(txid)s::text::xid8, %(seq)s)
  AND created_at < now() - make_interval(secs => %(retention_seconds)s);

-- name: reap_expired_leases
-- Jobs whose worker stopped heartbeating (killed, partitioned): back to queued, with the
-- history saying so, and a fresh job.requested through the outbox.
WITH expired AS (
    SELECT id FROM jobs
    WHERE status = 'running' AND lease_expires_at < now()
    ORDER BY lease_expires_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), requeued AS (
    UPDATE jobs j SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL,
                      updated_at = now()
    FROM expired e WHERE j.id = e.id
    RETURNING j.id, j.tenant_id, j.workflow, j.workflow_version, j.priority, j.pool, j.step,
              j.attempt, j.input_ref, j.deadline_at, j.created_at, j.trace_parent
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'requeued_after_restart', attempt, '{"reason": "lease_expired"}'::jsonb
    FROM requeued
), abandoned AS (
    UPDATE job_attempts a SET finished_at = now(), outcome = 'abandoned'
    FROM requeued r
    WHERE a.job_id = r.id AND a.step = r.step AND a.attempt = r.attempt AND a.finished_at IS NULL
)
SELECT * FROM requeued;

-- name: insert_outbox
INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers)
VALUES (%(id)s, %(route)s, %(aggregateid)s, %(type)s, %(payload)s, %(headers)s);

-- name: cancel_job
WITH cancelled AS (
    UPDATE jobs SET status = 'cancelled', lease_owner = NULL, lease_expires_at = NULL,
                    updated_at = now()
    WHERE id = %(id)s AND tenant_id = %(tenant_id)s
      AND status NOT IN ('completed', 'dead_letter', 'cancelled')
    RETURNING id, tenant_id, workflow, step, attempt, trace_parent
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'cancelled', attempt, '{}'::jsonb FROM cancelled
)
SELECT * FROM cancelled;
