-- Queries of the metrics samplers (producers/backlog.py, docs/reference/metrics.md).

-- name: obs_queue_age
-- The oldest waiting job (queued or retrying) per pool and priority, as seconds since it
-- started waiting (updated_at: set when it was queued, requeued or scheduled for retry).
-- A loose index scan over jobs_waiting: one probe per distinct (pool, priority) pair and one
-- per pair's oldest row, so the cost follows the number of pairs, not the backlog.
WITH RECURSIVE pairs AS (
    (SELECT pool, priority FROM jobs
     WHERE status IN ('queued', 'retrying')
     ORDER BY pool, priority LIMIT 1)
    UNION ALL
    SELECT n.pool, n.priority
    FROM pairs p CROSS JOIN LATERAL (
        SELECT pool, priority FROM jobs
        WHERE status IN ('queued', 'retrying') AND (pool, priority) > (p.pool, p.priority)
        ORDER BY pool, priority LIMIT 1
    ) n
)
SELECT p.pool, p.priority,
       GREATEST(0, extract(epoch FROM now() - o.oldest))::float8 AS age_seconds
FROM pairs p CROSS JOIN LATERAL (
    SELECT updated_at AS oldest FROM jobs
    WHERE status IN ('queued', 'retrying') AND pool = p.pool AND priority = p.priority
    ORDER BY updated_at LIMIT 1
) o;
