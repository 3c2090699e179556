-- Deleting tenant data (calmq/data/retention.py): redaction of a terminal job, and what is
-- past its retention.

-- name: retention_redact_job
-- Keep the row, its status and its history's shape; drop every piece of tenant data.
UPDATE jobs SET input = NULL, input_ref = NULL, metadata = '{}', callback_url = NULL,
                artifact = NULL,
                error = CASE WHEN error IS NULL THEN NULL
                             ELSE jsonb_build_object('code', error->'code', 'class',
                                                     error->'class', 'message', 'redacted') END,
                errors = '[]', redacted_at = now(), updated_at = now()
WHERE id = %(id)s AND tenant_id = %(tenant_id)s
  AND status IN ('completed', 'dead_letter', 'cancelled');

-- name: retention_redact_events
UPDATE job_events SET detail = '{}' WHERE job_id = %(id)s;

-- name: retention_expired_jobs
-- Terminal jobs past retention that still hold data, for the retention sweep.
SELECT id, tenant_id FROM jobs
WHERE redacted_at IS NULL AND status IN ('completed', 'dead_letter', 'cancelled')
  AND updated_at < now() - make_interval(secs => %(retention_seconds)s)
ORDER BY updated_at
LIMIT %(limit)s;

-- name: retention_prune_idempotency_keys
DELETE FROM idempotency_keys
WHERE created_at < now() - make_interval(secs => %(retention_seconds)s);
