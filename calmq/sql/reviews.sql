-- Human review (calmq/data/reviews.py): the jobs waiting for a person, and the statements of
-- one decision's transaction. Names start with wf_.

-- name: wf_pending_reviews
-- A tenant's jobs waiting for a person, oldest first, with what the model said.
SELECT j.id, j.workflow, j.step, j.review_deadline_at, j.updated_at, j.created_at,
       o.output, o.confidence
FROM jobs j JOIN step_outputs o ON o.job_id = j.id AND o.step = j.step
WHERE j.tenant_id = %(tenant_id)s AND j.status = 'awaiting_review'
  AND (j.updated_at, j.id) > (%(after_at)s, %(after_id)s)
ORDER BY j.updated_at, j.id
LIMIT %(limit)s;

-- name: wf_expired_reviews
SELECT id FROM jobs
WHERE status = 'awaiting_review' AND review_deadline_at < now()
ORDER BY review_deadline_at
LIMIT %(limit)s;

-- name: wf_lock_job
-- The job a reviewer decides on, locked for the decision's transaction.
SELECT id, tenant_id, workflow, workflow_version, status, priority, pool, step, attempt,
       input_ref, deadline_at, created_at, trace_parent, review_deadline_at, updated_at,
       metadata, input_tokens, output_tokens, cost_usd
FROM jobs WHERE id = %(id)s AND tenant_id = %(tenant_id)s
FOR UPDATE;

-- name: wf_lock_expired_review
-- The review timer: skip a job a reviewer is deciding on right now.
SELECT id, tenant_id, workflow, workflow_version, status, priority, pool, step, attempt,
       input_ref, deadline_at, created_at, trace_parent, review_deadline_at, updated_at,
       metadata, input_tokens, output_tokens, cost_usd
FROM jobs
WHERE id = %(id)s AND status = 'awaiting_review' AND review_deadline_at < now()
FOR UPDATE SKIP LOCKED;

-- name: wf_lock_step_output
SELECT state, output, model_output, confidence FROM step_outputs
WHERE job_id = %(job_id)s AND step = %(step)s
FOR UPDATE;

-- name: wf_review_step_output
UPDATE step_outputs SET state = %(state)s, output = %(output)s, reviewer = %(reviewer)s,
                        reviewed_at = now()
WHERE job_id = %(job_id)s AND step = %(step)s;

-- name: wf_review_resume
UPDATE jobs SET status = 'queued', step = %(next_step)s, pool = %(pool)s, attempt = 0,
                max_attempts = %(max_attempts)s, review_deadline_at = NULL, updated_at = now()
WHERE id = %(id)s AND status = 'awaiting_review'
-- The whole row, for job.requested (filled by the Avro schema's field names).
RETURNING *;

-- name: wf_review_complete
UPDATE jobs SET status = 'completed', artifact = %(artifact)s, error = NULL,
                review_deadline_at = NULL, updated_at = now()
WHERE id = %(id)s AND status = 'awaiting_review';

-- name: wf_review_dead_letter
UPDATE jobs SET status = 'dead_letter', error = %(error)s,
                errors = calmq_append_error(errors,
                    %(error)s || jsonb_build_object('attempt', attempt), %(keep_errors)s),
                review_deadline_at = NULL, updated_at = now()
WHERE id = %(id)s AND status = 'awaiting_review'
RETURNING errors;

-- name: wf_insert_event
INSERT INTO job_events (job_id, type, attempt, detail)
VALUES (%(job_id)s, %(type)s, %(attempt)s, %(detail)s);
