-- The waiting room's reads bound to the room's own index (issue 42's priority tail).
--
-- The room's queries (calmq/sql/fairness.sql) read jobs_fair_waiting, which holds exactly
-- the waiting rows of fair share in (pool, priority, tenant_id, created_at, id) order. Two
-- other indexes fit their WHERE clauses too, jobs_waiting (pool, priority, updated_at) and
-- jobs_waiting_reason (tenant_id, created_at), and the planner's choice among them, or a
-- sequential scan, followed the statistics of jobs:
-- - taken before a backlog moved into the room (every statistic says: no row waits), a
--   tenant's oldest waiting jobs were read through jobs_waiting and sorted: the pick took
--   20-25 ms a call on a room of 30,000 jobs, against 3 ms through jobs_fair_waiting;
-- - taken after it, whether an interactive room held any job was answered by a sequential
--   scan of jobs that expected to meet one at once (30,000 bulk jobs waiting made the
--   reason look common) and met none: 26 ms a call here, 60 ms in `calmq bench priority`,
--   where that look (every fill of a worker's free slots) was the database's heaviest
--   statement, 7.4 ms of its time a job.
-- These functions read the index in its own order with sorts and sequential scans priced
-- out (SET: only for their own statements), so no statistics can move them elsewhere.
SET LOCAL lock_timeout = '5s';

-- The first tenant after p_after (NULL: the first of all) with a job waiting in the room
-- of the queue (pool and priority); NULL: none. One probe of the index: the pick's skip
-- scan over the room's tenants, and the look into a room.
CREATE OR REPLACE FUNCTION calmq_fair_next_tenant(p_pool text, p_priority text, p_after uuid)
RETURNS uuid LANGUAGE plpgsql STABLE
SET enable_seqscan = off SET enable_sort = off SET enable_incremental_sort = off
AS $$
BEGIN
    IF p_after IS NULL THEN
        RETURN (SELECT j.tenant_id FROM jobs j
                WHERE j.waiting_reason = 'fair_share' AND j.status IN ('queued', 'retrying')
                  AND j.pool = p_pool AND j.priority = p_priority AND j.tenant_id IS NOT NULL
                ORDER BY j.tenant_id, j.created_at, j.id
                LIMIT 1);
    END IF;
    RETURN (SELECT j.tenant_id FROM jobs j
            WHERE j.waiting_reason = 'fair_share' AND j.status IN ('queued', 'retrying')
              AND j.pool = p_pool AND j.priority = p_priority AND j.tenant_id > p_after
            ORDER BY j.tenant_id, j.created_at, j.id
            LIMIT 1);
END
$$;

-- A tenant's p_limit oldest jobs waiting in the queue's room, oldest first. ROWS: a pick
-- asks for a handful; at the default estimate (1,000 a call) the pick's planner locked and
-- updated its choice through a hash join over a sequential scan of jobs.
CREATE OR REPLACE FUNCTION calmq_fair_oldest(p_pool text, p_priority text, p_tenant uuid,
                                             p_limit integer)
RETURNS TABLE (id uuid, created_at timestamptz) LANGUAGE sql STABLE ROWS 10
SET enable_seqscan = off SET enable_sort = off SET enable_incremental_sort = off
AS $$
    SELECT j.id, j.created_at FROM jobs j
    WHERE j.waiting_reason = 'fair_share' AND j.status IN ('queued', 'retrying')
      AND j.pool = p_pool AND j.priority = p_priority AND j.tenant_id = p_tenant
    ORDER BY j.created_at, j.id
    LIMIT p_limit
$$;
