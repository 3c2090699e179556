-- Queue age (docs/reference/metrics.md): the oldest waiting job per pool and priority is read
-- every few seconds. This index holds only waiting jobs, ordered so that the distinct
-- (pool, priority) pairs and each pair's oldest row are a few index probes, not a scan.
CREATE INDEX jobs_waiting ON jobs (pool, priority, updated_at)
    WHERE status IN ('queued', 'retrying');
