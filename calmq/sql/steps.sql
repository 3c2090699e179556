-- Workflow steps (calmq/data/steps.py): recorded step outputs and the side-effect log.
-- wf_record_step_output runs in the attempts' group commit (calmq/data/attempts.py).
-- Names start with wf_.

-- name: wf_record_step_output
-- Runs in the group-commit transaction just before finish_attempts, under the same guard
-- (the attempt's fencing token): a late finish (after a reaper, a cancel or a newer claim
-- took the job) records nothing. The row is locked here already, so a claim cannot slip in
-- between this check and finish_attempts' (which would leave an output without its move).
-- It also points the job at its next step's pool and attempt budget, and sets a review
-- deadline.
WITH held AS (
    SELECT id FROM jobs
    WHERE id = %(job_id)s AND lease_owner = %(worker)s AND status = 'running'
      AND lease_version = %(lease_version)s
    FOR UPDATE
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
-- Only for the attempt that holds the job (its fencing token, as in finish_attempts): a
-- stale attempt gets held = false and must not make the call. The row lock (shared) orders
-- this check against a claim that takes the job over.
WITH held AS (
    SELECT id FROM jobs
    WHERE id = %(job_id)s AND lease_owner = %(worker)s AND status = 'running'
      AND lease_version = %(lease_version)s
    FOR SHARE
), effect AS (
    INSERT INTO side_effects (job_id, key, state)
    SELECT id, %(key)s, 'called' FROM held
    ON CONFLICT (job_id, key) DO UPDATE SET calls = side_effects.calls + 1, called_at = now()
        WHERE side_effects.state = 'called'
    RETURNING state, calls
)
SELECT EXISTS (SELECT 1 FROM held) AS held, (SELECT calls FROM effect) AS calls;

-- name: wf_effect_confirmed
-- Under the same guard: a stale attempt's answer is not recorded. The attempt holding the
-- job calls again with the same idempotency key, and the external system answers it with
-- the first posting (calmq.workflows.effects), as after a crash between call and confirm.
WITH held AS (
    SELECT id FROM jobs
    WHERE id = %(job_id)s AND lease_owner = %(worker)s AND status = 'running'
      AND lease_version = %(lease_version)s
    FOR SHARE
), confirmed AS (
    UPDATE side_effects s SET state = 'confirmed', response = %(response)s,
                              confirmed_at = now()
    FROM held WHERE s.job_id = held.id AND s.key = %(key)s
)
SELECT EXISTS (SELECT 1 FROM held) AS held;
