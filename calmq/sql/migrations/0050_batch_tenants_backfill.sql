-- The tenants' shares of the batches recorded before 0049 (no reservation: their requests
-- were packed unreserved, and their results are recorded as spend when they come back).
-- Reads batch_jobs and jobs only: settlements go on meanwhile, and a share they change
-- after this snapshot is counted there already or not at all (a pending request settled
-- later does not update a share this file has not written yet: its counts may lag by that).
INSERT INTO batch_tenants (batch_key, tenant_id, created_at, requests, settled, retried,
                           cancelled, cost_usd, online_cost_usd, reserved_day)
SELECT bj.batch_key, j.tenant_id, b.created_at, count(*)::int,
       count(*) FILTER (WHERE bj.state = 'settled')::int,
       count(*) FILTER (WHERE bj.state = 'retried')::int,
       count(*) FILTER (WHERE bj.state = 'cancelled')::int,
       sum(bj.cost_usd), sum(bj.online_cost_usd), (b.created_at AT TIME ZONE 'UTC')::date
FROM batch_jobs bj
JOIN jobs j ON j.id = bj.job_id
JOIN provider_batches b ON b.key = bj.batch_key
GROUP BY bj.batch_key, j.tenant_id, b.created_at
ON CONFLICT (batch_key, tenant_id) DO NOTHING;
