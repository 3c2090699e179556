-- Named queries of durable workflows, human review and recorded side effects
-- (calmq/workflows/records.py, calmq/reviews.py). Names start with wf_.

-- name: wf_record_step_output
-- Runs in the group-commit transaction just before finish_attempts, under the same lease
-- guard: a late finish (after a reaper or a cancel took the job) records nothing. It also
-- points the job at its next step's pool and attempt budget, and sets a review deadline.
WITH held AS (
    SELECT id FROM jobs
    WHERE id = %(job_id)s AND lease_owner = %(worker)s AND status = 'running'
), recorded AS (
    INSERT INTO step_outputs (job_id, step, state, output, model_output, confidence)
    SELECT id, %(step)s, %(state)s, %(output)s, %(output)s, %(confidence)s FROM held
    ON CONFLICT (job_id, step) DO UPDATE
        SET state = EXCLUDED.state, output = EXCLUDED.output,
            model_output = EXCLUDED.model_output, confidence = EXCLUDED.confidence,
            reviewer = NULL, reviewed_at = NULL, recorded_at = now()
)
UPDATE jobs j SET review_deadline_at = %(review_deadline_at)s,
                  pool = COALESCE(%(next_pool)s, j.pool),
                  max_attempts = COALESCE(%(next_max_attempts)s, j.max_attempts)
FROM held WHERE j.id = held.id;

-- name: wf_step_outputs
SELECT step, state, output, model_output, confidence, reviewer, reviewed_at, recorded_at
FROM step_outputs WHERE job_id = %(job_id)s;

-- name: wf_step_attempts
SELECT step, count(*)::int AS attempts, max(attempt) AS last_attempt
FROM job_attempts WHERE job_id = %(job_id)s GROUP BY step;

-- name: wf_lock_job
-- The job a reviewer decides on, locked for the decision's transaction.
SELECT id, tenant_id, workflow, workflow_version, status, priority, pool, step, attempt,
       input_ref, deadline_at, created_at, trace_parent, review_deadline_at, updated_at
FROM jobs WHERE id = %(id)s AND tenant_id = %(tenant_id)s
FOR UPDATE;

-- name: wf_lock_expired_review
-- The review timer: skip a job a reviewer is deciding on right now.
SELECT id, tenant_id, workflow, workflow_version, status, priority, pool, step, attempt,
       input_ref, deadline_at, created_at, trace_parent, review_deadline_at, updated_at
FROM jobs
WHERE id = %(id)s AND status = 'awaiting_review' AND review_deadline_at < now()
FOR UPDATE SKIP LOCKED;

-- name: wf_expired_reviews
SELECT id FROM jobs
WHERE status = 'awaiting_review' AND review_deadline_at < now()
ORDER BY review_deadline_at
LIMIT %(limit)s;

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
RETURNING id, tenant_id, workflow, workflow_version, priority, pool, step, attempt,
          input_ref, deadline_at, created_at, trace_parent;

-- name: wf_review_complete
UPDATE jobs SET status = 'completed', artifact = %(artifact)s, error = NULL,
                review_deadline_at = NULL, updated_at = now()
WHERE id = %(id)s AND status = 'awaiting_review';

-- name: wf_review_dead_letter
UPDATE jobs SET status = 'dead_letter', error = %(error)s,
                errors = errors || jsonb_build_array(%(error)s || jsonb_build_object('attempt', attempt)),
                review_deadline_at = NULL, updated_at = now()
WHERE id = %(id)s AND status = 'awaiting_review'
RETURNING errors;

-- name: wf_insert_event
INSERT INTO job_events (job_id, type, attempt, detail)
VALUES (%(job_id)s, %(type)s, %(attempt)s, %(detail)s);

-- name: wf_pending_reviews
-- A tenant's jobs waiting for a person, oldest first, with what the model said.
SELECT j.id, j.workflow, j.step, j.review_deadline_at, j.updated_at, j.created_at,
       o.output, o.confidence
FROM jobs j JOIN step_outputs o ON o.job_id = j.id AND o.step = j.step
WHERE j.tenant_id = %(tenant_id)s AND j.status = 'awaiting_review'
  AND (j.updated_at, j.id) > (%(after_at)s, %(after_id)s)
ORDER BY j.updated_at, j.id
LIMIT %(limit)s;

-- name: wf_effect_get
SELECT state, calls, response FROM side_effects WHERE job_id = %(job_id)s AND key = %(key)s;

-- name: wf_effect_called
-- Record the intent before the call; a second call of an unconfirmed effect counts itself.
INSERT INTO side_effects (job_id, key, state) VALUES (%(job_id)s, %(key)s, 'called')
ON CONFLICT (job_id, key) DO UPDATE SET calls = side_effects.calls + 1, called_at = now()
    WHERE side_effects.state = 'called'
RETURNING state, calls;

-- name: wf_effect_confirmed
UPDATE side_effects SET state = 'confirmed', response = %(response)s, confirmed_at = now()
WHERE job_id = %(job_id)s AND key = %(key)s;
