-- The last day's hours from before 0040's trigger: the attempts' tokens and cost less what
-- spend_hours and the deltas not folded yet already hold of them (one statement, one
-- snapshot: a change of usage commits with its delta, and a fold moves deltas into
-- spend_hours in one transaction), so the hours plus every delta count each change once,
-- even if a release pass folded between the two files. No lock beyond reading: finishes
-- go on while it sums. The console reads the last 24 hours only.
INSERT INTO spend_hours AS h (hour, tenant_id, tokens, cost_usd, retry_cost_usd)
SELECT hour, tenant_id, sum(tokens), sum(cost_usd), sum(retry_cost_usd)
FROM (
    SELECT date_trunc('hour', a.started_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC' AS hour,
           j.tenant_id, a.input_tokens + a.output_tokens AS tokens, a.cost_usd,
           CASE WHEN a.outcome IS DISTINCT FROM 'completed' THEN a.cost_usd ELSE 0 END
               AS retry_cost_usd
    FROM job_attempts a JOIN jobs j ON j.id = a.job_id
    WHERE a.started_at >= date_trunc('hour', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                          - interval '24 hours'
      AND (a.cost_usd <> 0 OR a.input_tokens <> 0 OR a.output_tokens <> 0)
    UNION ALL
    SELECT hour, tenant_id, -tokens, -cost_usd, -retry_cost_usd FROM spend_hour_deltas
    WHERE hour >= date_trunc('hour', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                  - interval '24 hours'
    UNION ALL
    SELECT hour, tenant_id, -tokens, -cost_usd, -retry_cost_usd FROM spend_hours
    WHERE hour >= date_trunc('hour', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
                  - interval '24 hours'
) spent
GROUP BY hour, tenant_id
HAVING sum(tokens) <> 0 OR sum(cost_usd) <> 0 OR sum(retry_cost_usd) <> 0
ON CONFLICT (hour, tenant_id) DO UPDATE
    SET tokens = h.tokens + excluded.tokens, cost_usd = h.cost_usd + excluded.cost_usd,
        retry_cost_usd = h.retry_cost_usd + excluded.retry_cost_usd;
