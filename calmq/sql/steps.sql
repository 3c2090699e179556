-- Workflow steps (calmq/data/steps.py): recorded step outputs and the side-effect log.
-- wf_record_step_output runs in the attempts' group commit (calmq/data/attempts.py).
-- Names start with wf_.

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
