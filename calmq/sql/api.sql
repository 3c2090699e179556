-- Named queries of the intake API (producers/): listing and streaming a tenant's jobs.
-- Names start with api_ so they cannot collide with other areas (webhooks.sql and
-- retention.sql hold the webhook deliveries and the deletion of tenant data).

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
