-- The last day's bins from before 0042's trigger: the completed and dead_lettered events of
-- the history less what finish_bins and the deltas not folded yet already hold of them (one
-- statement, one snapshot: an event commits with its delta, and a fold moves deltas into
-- finish_bins in one transaction), so each event counts once, even if a release pass folded
-- between the two files. A job's cost is read as it is now (a job redriven since it finished
-- counts what it cost since, too). No lock beyond reading: finishes go on while it sums. The
-- console reads the last 24 hours at most.
INSERT INTO finish_bins AS b (bin, tenant_id, type, jobs, cost_usd)
SELECT bin, tenant_id, type, sum(jobs), sum(cost_usd)
FROM (
    SELECT date_bin('5 minutes', e.at, 'epoch'::timestamptz) AS bin, j.tenant_id, e.type,
           1 AS jobs, j.cost_usd
    FROM job_events e JOIN jobs j ON j.id = e.job_id
    WHERE e.type IN ('completed', 'dead_lettered')
      AND e.at >= date_bin('5 minutes', now(), 'epoch'::timestamptz) - interval '24 hours'
    UNION ALL
    SELECT bin, tenant_id, type, -jobs, -cost_usd FROM finish_bin_deltas
    WHERE bin >= date_bin('5 minutes', now(), 'epoch'::timestamptz) - interval '24 hours'
    UNION ALL
    SELECT bin, tenant_id, type, -jobs, -cost_usd FROM finish_bins
    WHERE bin >= date_bin('5 minutes', now(), 'epoch'::timestamptz) - interval '24 hours'
) finished
GROUP BY bin, tenant_id, type
HAVING sum(jobs) <> 0 OR sum(cost_usd) <> 0
ON CONFLICT (bin, tenant_id, type) DO UPDATE
    SET jobs = b.jobs + excluded.jobs, cost_usd = b.cost_usd + excluded.cost_usd;
