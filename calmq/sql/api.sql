-- Named queries of the intake API (producers/): listing, streaming, deletion, webhooks,
-- retention. Names start with api_ so they cannot collide with other areas.

-- name: api_list_jobs
-- Newest first; the cursor is the (created_at, id) of the last row of the previous page,
-- which the jobs_tenant_created index serves without an OFFSET scan.
SELECT id, workflow, status, attempt, step, artifact, error, created_at, updated_at
FROM jobs
WHERE tenant_id = %(tenant_id)s
  AND (%(statuses)s::text[] IS NULL OR status = ANY(%(statuses)s::text[]))
  AND (%(workflow)s::text IS NULL OR workflow = %(workflow)s::text)
  AND (%(created_after)s::timestamptz IS NULL OR created_at >= %(created_after)s::timestamptz)
  AND (%(created_before)s::timestamptz IS NULL OR created_at < %(created_before)s::timestamptz)
  AND (%(cursor_at)s::timestamptz IS NULL
       OR (created_at, id) < (%(cursor_at)s::timestamptz, %(cursor_id)s::uuid))
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s;

-- name: api_job_events_after
SELECT id, type, at, attempt, detail FROM job_events
WHERE job_id = %(id)s AND id > %(after)s ORDER BY id;

-- name: api_job_status
SELECT status, input_ref, artifact, redacted_at FROM jobs
WHERE id = %(id)s AND tenant_id = %(tenant_id)s;

-- name: api_redact_job
-- Keep the row, its status and its history's shape; drop every piece of tenant data.
UPDATE jobs SET input = NULL, input_ref = NULL, metadata = '{}', callback_url = NULL,
                artifact = NULL,
                error = CASE WHEN error IS NULL THEN NULL
                             ELSE jsonb_build_object('code', error->'code', 'class',
                                                     error->'class', 'message', 'redacted') END,
                errors = '[]', redacted_at = now(), updated_at = now()
WHERE id = %(id)s AND tenant_id = %(tenant_id)s
  AND status IN ('completed', 'dead_letter', 'cancelled');

-- name: api_redact_events
UPDATE job_events SET detail = '{}' WHERE job_id = %(id)s;

-- name: api_expired_jobs
-- Terminal jobs past retention that still hold data, for the retention sweep.
SELECT id, tenant_id FROM jobs
WHERE redacted_at IS NULL AND status IN ('completed', 'dead_letter', 'cancelled')
  AND updated_at < now() - make_interval(secs => %(retention_seconds)s)
ORDER BY updated_at
LIMIT %(limit)s;

-- name: api_prune_idempotency_keys
DELETE FROM idempotency_keys
WHERE created_at < now() - make_interval(secs => %(retention_seconds)s);

-- name: api_claim_webhooks
-- Due deliveries for this dispatcher; SKIP LOCKED lets several API processes share them,
-- and pushing next_at forward is the lease: a dispatcher killed mid-send leaves the row
-- to be tried again after lease_seconds.
WITH due AS (
    SELECT id FROM webhook_deliveries
    WHERE status = 'pending' AND next_at <= now()
    ORDER BY next_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE webhook_deliveries d
SET next_at = now() + make_interval(secs => %(lease_seconds)s), attempts = d.attempts + 1
FROM due, tenants t
WHERE d.id = due.id AND t.id = d.tenant_id
RETURNING d.id, d.job_id, d.tenant_id, d.url, d.event_type, d.attempts, t.webhook_secret;

-- name: api_webhook_attempt
INSERT INTO webhook_attempts (delivery_id, attempt, status_code, error, duration_ms)
VALUES (%(id)s, %(attempt)s, %(status_code)s, %(error)s, %(duration_ms)s);

-- name: api_webhook_done
UPDATE webhook_deliveries
SET status = %(status)s,
    next_at = CASE WHEN %(status)s = 'pending'
                   THEN now() + make_interval(secs => %(delay_seconds)s) ELSE next_at END,
    finished_at = CASE WHEN %(status)s = 'pending' THEN NULL ELSE now() END
WHERE id = %(id)s;

-- name: api_next_webhook_due
SELECT EXTRACT(EPOCH FROM (min(next_at) - now()))::float8 AS seconds
FROM webhook_deliveries WHERE status = 'pending';
