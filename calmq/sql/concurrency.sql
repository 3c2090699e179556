-- Concurrency keys (calmq/data/concurrency.py, migration 0045): at most a workflow's
-- concurrency_limit of one (tenant, key)'s jobs in flight, fleet-wide. A job in flight for
-- its key: running, or admitted (key_admitted_at) within %(admitted_seconds)s and not
-- claimed yet. Every statement that decides about a key first takes the key's advisory lock
-- in its transaction (concurrency_lock_*), so two workers' admissions, and an admission
-- and a release, take turns per key and never both see room for its last place.

-- name: concurrency_lock_jobs
-- The keys of a claim batch's jobs, locked in one order (tenant, key) so that two workers
-- locking overlapping keys cannot deadlock. Held until the transaction ends.
SELECT count(pg_advisory_xact_lock(hashtextextended(k.tenant_id::text || '/' || k.key, 31)))
FROM (SELECT DISTINCT tenant_id, concurrency_key AS key FROM jobs
      WHERE id = ANY(%(ids)s) AND concurrency_key IS NOT NULL
      ORDER BY 1, 2) k;

-- name: concurrency_lock_held
-- The keys that have jobs waiting for them (the release pass), locked in the same order;
-- returns them. The release then looks at these keys only: a key whose first job began to
-- wait after this statement's snapshot is not locked, and another worker may be admitting
-- one of its jobs right now (uncommitted, so not counted): releasing for it could pass the
-- limit. Its turn comes at the next pass.
SELECT k.tenant_id, k.key
FROM (SELECT DISTINCT tenant_id, concurrency_key AS key FROM jobs
      WHERE waiting_reason = 'concurrency_key' AND status IN ('queued', 'retrying')
      ORDER BY 1, 2) k,
     LATERAL (SELECT pg_advisory_xact_lock(
                  hashtextextended(k.tenant_id::text || '/' || k.key, 31))) l
ORDER BY 1, 2;

-- name: concurrency_admit
-- Of a claim batch's jobs (ids) of the workflows with a limit (limits: {workflow: limit}),
-- admit what fits under each key's limit and hold the rest (queued or retrying, reason
-- concurrency_key, no attempt counted; the event is written when a job starts to wait).
-- A job the release pass let go (admitted already) goes first, then the oldest. Runs after
-- concurrency_lock_jobs in one transaction: its snapshot is taken after the locks, so it
-- sees every admission that took turns before it. Returns the jobs held.
WITH target AS (
    SELECT j.id, j.tenant_id, j.concurrency_key AS key, j.created_at, j.attempt,
           j.waiting_reason AS old_reason,
           coalesce(j.key_admitted_at > now() - make_interval(secs => %(admitted_seconds)s),
                    false) AS admitted,
           (%(limits)s::jsonb ->> j.workflow)::int AS lim
    FROM jobs j
    WHERE j.id = ANY(%(ids)s) AND j.concurrency_key IS NOT NULL
      AND j.status IN ('queued', 'retrying') AND %(limits)s::jsonb ? j.workflow
    ORDER BY j.id
    FOR UPDATE
), used AS (
    SELECT k.tenant_id, k.key, (
        SELECT count(*) FROM jobs o
        WHERE o.tenant_id = k.tenant_id AND o.concurrency_key = k.key
          AND o.status IN ('queued', 'retrying', 'running')
          AND o.id NOT IN (SELECT id FROM target)
          AND (o.status = 'running'
               OR o.key_admitted_at > now() - make_interval(secs => %(admitted_seconds)s))
    ) AS used
    FROM (SELECT DISTINCT tenant_id, key FROM target) k
), ranked AS (
    SELECT t.id, t.key, t.attempt, t.old_reason, t.lim, u.used,
           row_number() OVER (PARTITION BY t.tenant_id, t.key
                              ORDER BY t.admitted DESC, t.created_at, t.id) AS n
    FROM target t JOIN used u ON u.tenant_id = t.tenant_id AND u.key = t.key
), admitted AS (
    UPDATE jobs j SET key_admitted_at = now(), waiting_reason = NULL
    FROM ranked r WHERE j.id = r.id AND r.used + r.n <= r.lim
    RETURNING j.id
), held AS (
    UPDATE jobs j SET waiting_reason = 'concurrency_key', key_admitted_at = NULL,
                      updated_at = CASE WHEN r.old_reason IS DISTINCT FROM 'concurrency_key'
                                        THEN now() ELSE j.updated_at END
    FROM ranked r WHERE j.id = r.id AND r.used + r.n > r.lim
    RETURNING j.id, r.key, r.lim, r.used, r.attempt, r.old_reason
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'waiting', attempt,
           jsonb_build_object('reason', 'concurrency_key', 'key', key, 'limit', lim,
                              'in_flight', used)
    FROM held WHERE old_reason IS DISTINCT FROM 'concurrency_key'
)
SELECT id FROM held;

-- name: concurrency_release
-- The release pass: per key with jobs waiting for it, as many of them (oldest first) as its
-- limit has room for, admitted at once (key_admitted_at) so that the worker that gets their
-- fresh message (written by the caller in this transaction) lets them through. Only jobs of
-- the workflows this process knows (known): one with a limit (limits) by it, one whose limit
-- was removed all at once. A process that does not know a job's workflow (a worker of
-- another pool, loading other workflow modules) leaves the job to those that do: it cannot
-- tell a limit it does not see from none. Runs after concurrency_lock_held, on the keys it
-- locked (tenants, keys: in pairs).
WITH room AS (
    SELECT k.tenant_id, k.key, (
        SELECT count(*) FROM jobs o
        WHERE o.tenant_id = k.tenant_id AND o.concurrency_key = k.key
          AND o.status IN ('queued', 'retrying', 'running')
          AND (o.status = 'running'
               OR o.key_admitted_at > now() - make_interval(secs => %(admitted_seconds)s))
    ) AS used
    FROM unnest(%(tenants)s::uuid[], %(keys)s::text[]) AS k(tenant_id, key)
), ranked AS (
    SELECT j.id, r.used,
           coalesce((%(limits)s::jsonb ->> j.workflow)::int, 2147483647) AS lim,
           row_number() OVER (PARTITION BY j.tenant_id, j.concurrency_key
                              ORDER BY j.created_at, j.id) AS n
    FROM jobs j JOIN room r ON r.tenant_id = j.tenant_id AND r.key = j.concurrency_key
    WHERE j.waiting_reason = 'concurrency_key' AND j.status IN ('queued', 'retrying')
      AND j.workflow = ANY(%(known)s::text[])
), chosen AS (
    SELECT j.id FROM jobs j JOIN ranked r ON r.id = j.id
    WHERE r.used + r.n <= r.lim
    ORDER BY j.id
    LIMIT %(limit)s
    FOR UPDATE OF j
), moved AS (
    UPDATE jobs j SET waiting_reason = NULL, key_admitted_at = now(), updated_at = now()
    FROM chosen c WHERE j.id = c.id
    RETURNING {{job_row}}, j.status AS old_status
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'resumed', attempt, '{"reason": "concurrency_key"}'::jsonb FROM moved
)
SELECT * FROM moved;
