-- Named queries of the fleet's provider states (calmq/calls/gate.py, calmq/data/providers.py).

-- name: provider_block
-- Block a provider and model fleet-wide; the first reason is kept while it stays blocked.
INSERT INTO provider_states (provider, model, blocked_reason, blocked_code, blocked_message,
                             blocked_at)
VALUES (%(provider)s, %(model)s, %(reason)s, %(code)s, %(message)s, now())
ON CONFLICT (provider, model) DO UPDATE SET
    blocked_reason = coalesce(provider_states.blocked_reason, excluded.blocked_reason),
    blocked_code = coalesce(provider_states.blocked_code, excluded.blocked_code),
    blocked_message = coalesce(provider_states.blocked_message, excluded.blocked_message),
    blocked_at = coalesce(provider_states.blocked_at, excluded.blocked_at),
    updated_at = now();

-- name: provider_unblock
-- Lift a block (a probe call succeeded, or `calmq provider unblock`); NULL provider or
-- model: every one. Returns what was lifted.
UPDATE provider_states SET blocked_reason = NULL, blocked_code = NULL,
                           blocked_message = NULL, blocked_at = NULL, updated_at = now()
WHERE blocked_reason IS NOT NULL
  AND (%(provider)s::text IS NULL OR provider = %(provider)s::text)
  AND (%(model)s::text IS NULL OR model = %(model)s::text)
RETURNING provider, model;

-- name: provider_pause
-- A rate limit: no call to this provider and model until the provider's retry-after.
INSERT INTO provider_states (provider, model, paused_until)
VALUES (%(provider)s, %(model)s, clock_timestamp() + make_interval(secs => %(seconds)s))
ON CONFLICT (provider, model) DO UPDATE SET
    paused_until = greatest(provider_states.paused_until, excluded.paused_until),
    updated_at = now()
RETURNING extract(epoch FROM paused_until - clock_timestamp())::float8 AS seconds_left;

-- name: provider_unpause
-- Lift a rate-limit pause early (`calmq provider unpause`); NULL provider or model: every
-- paused one. The token budget's fleet pause of the same endpoint and model goes too (its
-- bucket names the endpoint without the key's fingerprint). Returns what was lifted.
WITH lifted AS (
    UPDATE provider_states SET paused_until = '-infinity', updated_at = now()
    WHERE paused_until > clock_timestamp()
      AND (%(provider)s::text IS NULL OR provider = %(provider)s::text)
      AND (%(model)s::text IS NULL OR model = %(model)s::text)
    RETURNING provider, model
), budget AS (
    UPDATE budget_buckets b SET paused_until = '-infinity', updated_at = now()
    WHERE b.paused_until > clock_timestamp()
      AND (%(provider)s::text IS NULL
           OR b.provider = split_part(%(provider)s::text, '#key-', 1))
      AND (%(model)s::text IS NULL OR b.model = %(model)s::text)
    RETURNING b.provider, b.model
)
SELECT provider, model, 'provider' AS pause FROM lifted
UNION ALL
SELECT provider, model, 'budget' AS pause FROM budget;

-- name: provider_observe
-- The limits the provider's rate-limit headers stated.
INSERT INTO provider_states (provider, model, observed_tokens_per_minute,
                             observed_requests_per_minute, observed_at)
VALUES (%(provider)s, %(model)s, %(tokens_per_minute)s, %(requests_per_minute)s, now())
ON CONFLICT (provider, model) DO UPDATE SET
    observed_tokens_per_minute = coalesce(excluded.observed_tokens_per_minute,
                                          provider_states.observed_tokens_per_minute),
    observed_requests_per_minute = coalesce(excluded.observed_requests_per_minute,
                                            provider_states.observed_requests_per_minute),
    observed_at = now(), updated_at = now();

-- name: provider_states
-- Every provider and model's state; paused_seconds: how long the pause still runs (0: none).
SELECT provider, model, blocked_reason, blocked_code, blocked_message, blocked_at,
       greatest(0, extract(epoch FROM paused_until - clock_timestamp()))::float8
           AS paused_seconds,
       observed_tokens_per_minute, observed_requests_per_minute, observed_at
FROM provider_states ORDER BY provider, model;

-- name: provider_notify
-- Tell every worker at once (LISTEN calmq_providers): a block, a lift or a pause.
SELECT pg_notify('calmq_providers', %(payload)s);

-- name: provider_hand_back
-- An attempt that met a blocked provider (reason provider_blocked), or found every model
-- its step allows cooling down (reason model_cooldown, for wait_seconds), is not the job's
-- attempt: the job goes back to queued at the attempt before (its attempt row removed: none
-- is counted), its lease dropped, waiting for its reason (the release writes a fresh
-- job.requested). Only while the attempt still holds the job (its lease version and owner).
WITH held AS (
    SELECT id, step, attempt, created_at FROM jobs
    WHERE id = %(id)s AND lease_version = %(lease_version)s AND lease_owner = %(worker)s
      AND status = 'running'
    FOR UPDATE
), back AS (
    UPDATE jobs j SET status = 'queued', attempt = j.attempt - 1,
                      lease_owner = NULL, lease_expires_at = NULL,
                      waiting_reason = %(reason)s,
                      waiting_until = now() + make_interval(secs => %(wait_seconds)s),
                      updated_at = now()
    FROM held WHERE j.id = held.id
    RETURNING j.id, held.step, held.attempt, held.created_at
), uncounted AS (
    DELETE FROM job_attempts a USING back
    WHERE a.job_id = back.id AND a.step = back.step AND a.attempt = back.attempt
      AND a.started_at >= back.created_at
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'waiting', attempt - 1, %(detail)s::jsonb FROM back
)
SELECT id FROM back;

-- name: provider_met_before
-- Whether the job was handed back already after its own call met a blocked provider's
-- refusal (a waiting event marked met): it is handed back once, not sent again at every
-- unblock for ever. Its history lies from its creation on (the partitions before it are
-- never opened: jobs.sql, job_events).
SELECT EXISTS (
    SELECT 1 FROM job_events h
    WHERE h.job_id = %(id)s AND h.type = 'waiting'
      AND h.at >= (SELECT k.created_at FROM jobs k WHERE k.id = %(id)s)
      AND h.detail->>'reason' = 'provider_blocked' AND h.detail->>'met' = 'true'
) AS met;

-- name: provider_release_jobs
-- Jobs that waited for a blocked provider, once a block lifted (oldest first, interactive
-- first): the reason is cleared and the caller writes a fresh job.requested in this
-- transaction. A job whose provider is still blocked meets the block again at once.
WITH released AS (
    SELECT j.id FROM jobs j
    WHERE j.waiting_reason = 'provider_blocked' AND j.status IN ('queued', 'retrying')
    ORDER BY j.priority = 'interactive' DESC, j.created_at
    LIMIT %(limit)s
    FOR UPDATE OF j SKIP LOCKED
), moved AS (
    UPDATE jobs j SET waiting_reason = NULL, updated_at = now()
    FROM released r WHERE j.id = r.id
    RETURNING {{job_row}}, j.status AS old_status
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'resumed', attempt, '{"reason": "provider_unblocked"}'::jsonb FROM moved
)
SELECT * FROM moved;

-- name: timed_wait_release_jobs
-- Jobs that waited a set time (waiting_until: every model of their step cooling down,
-- model_cooldown; their concurrency key at its rate limit, rate_limit_key), once it is
-- over: the reason is cleared and the caller writes a fresh job.requested in this
-- transaction. One that finds no room again is handed back again, uncounted. Only a timed
-- hand-back sets waiting_until, and the claim, this release and a cancel clear it: so the
-- time alone picks the jobs, which only jobs_timed_waiting serves (a status or reason
-- filter here let the planner take an index of every waiting job instead, whenever the
-- statistics said it was small).
WITH released AS (
    SELECT j.id, j.waiting_reason FROM jobs j
    WHERE j.waiting_until <= now()
    ORDER BY j.waiting_until
    LIMIT %(limit)s
    FOR UPDATE OF j SKIP LOCKED
), moved AS (
    UPDATE jobs j SET waiting_reason = NULL, waiting_until = NULL, updated_at = now()
    FROM released r WHERE j.id = r.id
    RETURNING {{job_row}}, j.status AS old_status, r.waiting_reason AS waited_for
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'resumed', attempt, jsonb_build_object('reason', waited_for) FROM moved
)
SELECT * FROM moved;

-- name: provider_waiting_jobs
SELECT count(*) AS n FROM jobs
WHERE waiting_reason = 'provider_blocked' AND status IN ('queued', 'retrying');
