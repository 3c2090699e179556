-- Named queries of the spend caps (calmq/spending.py, calmq/data/spending.py).

-- name: spend_caps
-- The tenants with a cap of their own.
SELECT id, spend_cap_daily_usd::float8 AS daily, spend_cap_monthly_usd::float8 AS monthly
FROM tenants WHERE spend_cap_daily_usd IS NOT NULL OR spend_cap_monthly_usd IS NOT NULL;

-- name: spend_by_tenant
-- What each tenant spent this UTC day and this UTC month: the cost of the attempts that
-- started in the window (retries and dead-lettered attempts included), as spend_days and
-- the deltas not folded into it yet hold it (migration 0038). An attempt's cost is written
-- with its outcome, so calls in flight are counted when they end. What open provider
-- batches reserve counts as spent until their results settle it (batch_tenants, migration
-- 0049): the batch lane's cost comes back hours after its requests were sent.
SELECT tenant_id,
       coalesce(sum(cost_usd) FILTER (WHERE day = (now() AT TIME ZONE 'UTC')::date),
                0)::float8 AS day,
       coalesce(sum(cost_usd), 0)::float8 AS month
FROM (SELECT day, tenant_id, cost_usd FROM spend_days
      WHERE day >= date_trunc('month', now() AT TIME ZONE 'UTC')::date
      UNION ALL
      SELECT day, tenant_id, cost_usd FROM spend_deltas
      WHERE day >= date_trunc('month', now() AT TIME ZONE 'UTC')::date
      UNION ALL
      SELECT reserved_day, tenant_id, reserved_usd FROM batch_tenants
      WHERE reserved_usd > 0
        AND reserved_day >= date_trunc('month', now() AT TIME ZONE 'UTC')::date) spent
GROUP BY tenant_id
HAVING sum(cost_usd) > 0;

-- name: spend_reserve_lock
-- Reservations against the same caps take turns (the batch lane packing, calmq/data/
-- batches.py): one advisory lock per tenant of the pack, and the fleet's ('fleet') when it
-- has a cap, taken in one order so that two batchers cannot deadlock; held until the
-- transaction that records the pack ends. A pack's read of what is spent and reserved
-- (spend_standing) then sees every reservation recorded before it.
SELECT count(pg_advisory_xact_lock(hashtextextended('calmq.spend_reserve/' || k.name, 0)))
FROM (SELECT DISTINCT name FROM unnest(%(names)s::text[]) AS n(name) ORDER BY 1) k;

-- name: spend_standing
-- What each of these tenants spent and reserved this UTC day and this UTC month (as
-- spend_by_tenant counts it), with its caps.
SELECT t.id AS tenant_id, t.spend_cap_daily_usd::float8 AS daily,
       t.spend_cap_monthly_usd::float8 AS monthly,
       coalesce(s.day, 0)::float8 AS spent_day, coalesce(s.month, 0)::float8 AS spent_month
FROM tenants t
CROSS JOIN LATERAL (
    SELECT sum(x.cost_usd) FILTER (WHERE x.day = (now() AT TIME ZONE 'UTC')::date) AS day,
           sum(x.cost_usd) AS month
    FROM (SELECT day, cost_usd FROM spend_days
          WHERE tenant_id = t.id
            AND day >= date_trunc('month', now() AT TIME ZONE 'UTC')::date
          UNION ALL
          SELECT day, cost_usd FROM spend_deltas
          WHERE tenant_id = t.id
            AND day >= date_trunc('month', now() AT TIME ZONE 'UTC')::date
          UNION ALL
          SELECT reserved_day, reserved_usd FROM batch_tenants
          WHERE tenant_id = t.id AND reserved_usd > 0
            AND reserved_day >= date_trunc('month', now() AT TIME ZONE 'UTC')::date) x
) s
WHERE t.id = ANY(%(tenants)s::uuid[]);

-- name: spend_fleet_standing
-- What the fleet spent and reserved this UTC day and this UTC month (spend_by_tenant's sum).
SELECT coalesce(sum(cost_usd) FILTER (WHERE day = (now() AT TIME ZONE 'UTC')::date),
                0)::float8 AS spent_day,
       coalesce(sum(cost_usd), 0)::float8 AS spent_month
FROM (SELECT day, cost_usd FROM spend_days
      WHERE day >= date_trunc('month', now() AT TIME ZONE 'UTC')::date
      UNION ALL
      SELECT day, cost_usd FROM spend_deltas
      WHERE day >= date_trunc('month', now() AT TIME ZONE 'UTC')::date
      UNION ALL
      SELECT reserved_day, reserved_usd FROM batch_tenants
      WHERE reserved_usd > 0
        AND reserved_day >= date_trunc('month', now() AT TIME ZONE 'UTC')::date) spent;

-- name: fold_spend
-- The deltas the attempts' trigger appended, added to their days (under the release pass's
-- lock: one fold at a time). Deltas committed after this statement's snapshot stay for the
-- next fold; a reader sees each delta in one place or the other, never both.
WITH folded AS (
    DELETE FROM spend_deltas RETURNING day, tenant_id, cost_usd
)
INSERT INTO spend_days (day, tenant_id, cost_usd)
SELECT day, tenant_id, sum(cost_usd) FROM folded
GROUP BY day, tenant_id
ORDER BY day, tenant_id
ON CONFLICT (day, tenant_id) DO UPDATE SET cost_usd = spend_days.cost_usd + excluded.cost_usd;

-- name: fold_spend_hours
-- The hours' deltas the attempts' trigger appended (migration 0040), added to their hours,
-- like fold_spend and in the same transaction.
WITH folded AS (
    DELETE FROM spend_hour_deltas RETURNING hour, tenant_id, tokens, cost_usd, retry_cost_usd
)
INSERT INTO spend_hours AS h (hour, tenant_id, tokens, cost_usd, retry_cost_usd)
SELECT hour, tenant_id, sum(tokens), sum(cost_usd), sum(retry_cost_usd) FROM folded
GROUP BY hour, tenant_id
ORDER BY hour, tenant_id
ON CONFLICT (hour, tenant_id) DO UPDATE
    SET tokens = h.tokens + excluded.tokens, cost_usd = h.cost_usd + excluded.cost_usd,
        retry_cost_usd = h.retry_cost_usd + excluded.retry_cost_usd;

-- name: prune_spend_hours
-- Hours no page shows any more (the console reads the last 24; the days stay in spend_days).
DELETE FROM spend_hours WHERE hour < now() - interval '8 days';

-- name: fold_finish_bins
-- The finished jobs the history trigger appended (migration 0042), added to their bins, like
-- fold_spend and in the same transaction.
WITH folded AS (
    DELETE FROM finish_bin_deltas RETURNING bin, tenant_id, type, jobs, cost_usd
)
INSERT INTO finish_bins AS b (bin, tenant_id, type, jobs, cost_usd)
SELECT bin, tenant_id, type, sum(jobs), sum(cost_usd) FROM folded
GROUP BY bin, tenant_id, type
ORDER BY bin, tenant_id, type
ON CONFLICT (bin, tenant_id, type) DO UPDATE
    SET jobs = b.jobs + excluded.jobs, cost_usd = b.cost_usd + excluded.cost_usd;

-- name: prune_finish_bins
-- Bins no page shows any more (the console reads the last 24 hours at most).
DELETE FROM finish_bins WHERE bin < now() - interval '8 days';

-- name: hold_jobs
-- Jobs of a tenant past a spend cap: they keep their status (queued, or retrying) and wait
-- with a reason instead of being claimed; the event says which cap (written when the reason
-- is new at the job's step and attempt: waited_for, which a release pass leaves in place,
-- migration 0048). The message that carried them is acknowledged: release_jobs writes a
-- fresh one. Returns every job of ids that now waits with this reason.
WITH target AS (
    SELECT id, waiting_reason AS old_reason, waited_for AS old_wait,
           format('%%s %%s %%s', %(reason)s::text, step, attempt) AS wait
    FROM jobs
    WHERE id = ANY(%(ids)s) AND status IN ('queued', 'retrying')
    ORDER BY id
    FOR UPDATE
), held AS (
    UPDATE jobs j SET waiting_reason = %(reason)s, waited_for = t.wait,
                      updated_at = CASE WHEN t.old_reason IS DISTINCT FROM %(reason)s
                                        THEN now() ELSE j.updated_at END
    FROM target t WHERE j.id = t.id
    RETURNING j.id, j.attempt, t.old_wait, t.wait
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'waiting', attempt, %(detail)s::jsonb FROM held
    WHERE old_wait IS DISTINCT FROM wait
)
SELECT id FROM held;

-- name: held_jobs_lock
-- One release pass at a time in the fleet (as the sweeper's).
SELECT pg_try_advisory_xact_lock(hashtextextended('calmq.spend_release', 0)) AS held;

-- name: release_jobs
-- Waiting jobs whose reason no longer holds (the window rolled over, the cap was raised):
-- the reason is cleared and the caller writes a fresh job.requested in this transaction.
-- A job stays waiting while its tenant, or the fleet, is still past the cap for its priority.
-- A job waiting for its token quota is released by the workers' quota pass (release_quota_
-- jobs); here only once it waited past stale_seconds (no worker runs quotas any more): it
-- comes back to wait again if its tenant is still crowded.
-- Only these reasons, the ones calmq.spending's holds write (spend_cap_<window>, and
-- fleet_spend_cap_<window> for the fleet's cap) and the token quota's: a job waiting for
-- anything else (its concurrency key, a waiting room, a provider's block, a review cap) has
-- a release pass of its own that knows when it may run; re-publishing it here after a
-- while let it past its key's limit, and called it a spend-cap release.
WITH released AS (
    SELECT j.id FROM jobs j
    WHERE j.waiting_reason IS NOT NULL AND j.status IN ('queued', 'retrying')
      AND (j.waiting_reason IN ('spend_cap_daily', 'spend_cap_monthly',
                                'fleet_spend_cap_daily', 'fleet_spend_cap_monthly')
           OR (j.waiting_reason = 'token_quota'
               AND j.updated_at < now() - make_interval(secs => %(stale_seconds)s)))
      AND NOT (j.tenant_id = ANY(%(held_bulk)s) AND j.priority <> 'interactive')
      AND NOT (j.tenant_id = ANY(%(held_all)s))
      AND NOT (%(fleet_bulk)s AND j.priority <> 'interactive')
      AND NOT %(fleet_all)s
    ORDER BY j.priority = 'interactive' DESC, j.created_at
    LIMIT %(limit)s
    FOR UPDATE OF j SKIP LOCKED
), moved AS (
    UPDATE jobs j SET waiting_reason = NULL, updated_at = now()
    FROM released r WHERE j.id = r.id
    RETURNING {{job_row}}, j.status AS old_status
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'resumed', attempt, '{"reason": "under_cap"}'::jsonb FROM moved
)
SELECT * FROM moved;

-- name: set_tenant_quota
UPDATE tenants SET tokens_per_minute = %(tokens_per_minute)s WHERE name = %(name)s
RETURNING id;

-- name: set_tenant_spend_cap
-- A window not given keeps its cap; given as NULL, it has none.
UPDATE tenants
SET spend_cap_daily_usd = CASE WHEN %(set_daily)s THEN %(daily)s::numeric
                               ELSE spend_cap_daily_usd END,
    spend_cap_monthly_usd = CASE WHEN %(set_monthly)s THEN %(monthly)s::numeric
                                 ELSE spend_cap_monthly_usd END
WHERE name = %(name)s
RETURNING id;

-- name: quota_held_tenants
-- Tenants with jobs waiting for their token quota (the jobs_waiting_reason index).
SELECT DISTINCT tenant_id FROM jobs
WHERE waiting_reason = 'token_quota' AND status IN ('queued', 'retrying');

-- name: quota_lock
-- One token-quota release pass at a time in the fleet.
SELECT pg_try_advisory_xact_lock(hashtextextended('calmq.quota_release', 0)) AS held;

-- name: release_quota_jobs
-- As many of a tenant's jobs waiting for its token quota as the quota serves until the next
-- pass (interactive first, then oldest): the reason is cleared and the caller writes a fresh
-- job.requested in this transaction.
WITH released AS (
    SELECT j.id FROM jobs j
    WHERE j.tenant_id = %(tenant_id)s AND j.waiting_reason = 'token_quota'
      AND j.status IN ('queued', 'retrying')
    ORDER BY j.priority = 'interactive' DESC, j.created_at
    LIMIT %(limit)s
    FOR UPDATE OF j SKIP LOCKED
), moved AS (
    UPDATE jobs j SET waiting_reason = NULL, updated_at = now()
    FROM released r WHERE j.id = r.id
    RETURNING {{job_row}}, j.status AS old_status
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'resumed', attempt, '{"reason": "quota_refilled"}'::jsonb FROM moved
)
SELECT * FROM moved;
