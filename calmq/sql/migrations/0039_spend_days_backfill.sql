-- What the month spent before 0038's trigger: the attempts' cost less the deltas the
-- trigger wrote since (a change of cost commits with its delta, and this one statement
-- reads both in one snapshot), so the days plus every delta count each change once. No
-- lock beyond reading: finishes go on while it sums. Spend caps read this month only.
INSERT INTO spend_days (day, tenant_id, cost_usd)
SELECT day, tenant_id, sum(cost_usd)
FROM (
    SELECT (a.started_at AT TIME ZONE 'UTC')::date AS day, j.tenant_id, a.cost_usd
    FROM job_attempts a JOIN jobs j ON j.id = a.job_id
    WHERE a.started_at >= date_trunc('month', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
      AND a.cost_usd <> 0
    UNION ALL
    SELECT day, tenant_id, -cost_usd FROM spend_deltas
    WHERE day >= date_trunc('month', now() AT TIME ZONE 'UTC')::date
) spent
GROUP BY day, tenant_id
HAVING sum(cost_usd) <> 0;
