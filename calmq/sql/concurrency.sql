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

-- name: concurrency_release_lock
-- One release pass at a time in the fleet (as the spend release's): every worker schedules
-- one five times a second, and passes that ran together would lock the same keys over and
-- over, each making the admissions of those keys wait.
SELECT pg_try_advisory_xact_lock(hashtextextended('calmq.concurrency_release', 0)) AS held;

-- name: concurrency_lock_held
-- The release pass's next keys: at most %(batch)s keys that have jobs of the workflows the
-- process knows (known) waiting for them, after the cursor (after_tenant, after_key; from
-- the first: the zero uuid and ''), locked in the same order; returns them. The LIMIT is inside the subquery,
-- before the locks: each lock takes an entry of PostgreSQL's shared lock table
-- (max_locks_per_transaction x max_connections: 6,400 with its defaults), and a pass that
-- locked every waiting key (tens of thousands, from one tenant's submits) would fill it and
-- leave no transaction in the database able to take a lock. The caller moves the cursor on
-- to the last key returned, so successive passes reach every key in turn.
-- The release then looks at these keys only: a key whose first job began to wait after this
-- statement's snapshot is not locked, and another worker may be admitting one of its jobs
-- right now (uncommitted, so not counted): releasing for it could pass the limit. Its turn
-- comes at a later pass.
-- The keys are found one after another (a loose index scan of jobs_concurrency_key: each
-- step seeks past the previous key's rows), so a key with many waiting jobs costs one step,
-- not a read of each.
WITH RECURSIVE next_key AS (
    (SELECT j.tenant_id, j.concurrency_key AS key, 1 AS n FROM jobs j
     WHERE j.waiting_reason = 'concurrency_key' AND j.status IN ('queued', 'retrying')
       AND j.concurrency_key IS NOT NULL AND j.workflow = ANY(%(known)s::text[])
       -- Never NULL: an OR here would leave a generic plan (prepared, after five runs)
       -- reading the index from its start.
       AND (j.tenant_id, j.concurrency_key) > (%(after_tenant)s::uuid, %(after_key)s::text)
     ORDER BY j.tenant_id, j.concurrency_key
     LIMIT 1)
    UNION ALL
    SELECT nx.tenant_id, nx.key, k.n + 1
    FROM next_key k,
         LATERAL (SELECT j.tenant_id, j.concurrency_key AS key FROM jobs j
                  WHERE j.waiting_reason = 'concurrency_key'
                    AND j.status IN ('queued', 'retrying')
                    AND j.concurrency_key IS NOT NULL AND j.workflow = ANY(%(known)s::text[])
                    AND (j.tenant_id, j.concurrency_key) > (k.tenant_id, k.key)
                  ORDER BY j.tenant_id, j.concurrency_key
                  LIMIT 1) nx
    WHERE k.n < %(batch)s
)
SELECT k.tenant_id, k.key
FROM (SELECT tenant_id, key FROM next_key ORDER BY tenant_id, key LIMIT %(batch)s) k,
     LATERAL (SELECT pg_advisory_xact_lock(
                  hashtextextended(k.tenant_id::text || '/' || k.key, 31))) l
ORDER BY 1, 2;

-- name: concurrency_admit
-- Of a claim batch's jobs (ids) of the workflows with a limit (limits: {workflow: limit}),
-- admit what fits under each key's limit and hold the rest (queued or retrying, no attempt
-- counted; the event is written when a job starts to wait or its reason changes).
-- A job the release pass let go (admitted already) goes first, then the oldest. Runs after
-- concurrency_lock_jobs in one transaction: its snapshot is taken after the locks, so it
-- sees every admission that took turns before it. Returns the jobs held.
-- A held job waits for its key (reason concurrency_key) while its tenant's jobs wait for at
-- most %(waiting_max)s distinct keys: a key that waits already takes no more room, a new
-- key takes one. Past that, it waits behind its tenant's keys (concurrency_keys_waiting),
-- oldest first, and the release pass lets it go as the tenant's keys stop waiting. The keys
-- the release pass cycles through then grow by at most waiting_max per tenant, so one
-- tenant's flood of customers cannot make every other tenant's keys wait their turn longer.
-- Two workers holding new keys of one tenant at once may each count the other's out (the
-- tenant is not locked): the cap may be passed by the keys of the batches held together.
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
    SELECT t.id, t.tenant_id, t.key, t.attempt, t.old_reason, t.lim, u.used,
           row_number() OVER (PARTITION BY t.tenant_id, t.key
                              ORDER BY t.admitted DESC, t.created_at, t.id) AS n
    FROM target t JOIN used u ON u.tenant_id = t.tenant_id AND u.key = t.key
), over AS (
    SELECT r.*, EXISTS (
        SELECT 1 FROM jobs w
        WHERE w.tenant_id = r.tenant_id AND w.concurrency_key = r.key
          AND w.waiting_reason = 'concurrency_key' AND w.status IN ('queued', 'retrying')
    ) AS key_waits
    FROM ranked r WHERE r.used + r.n > r.lim
), tenant_keys AS (
    -- The keys the tenant's jobs wait for, counted up to the cap (past it the number does
    -- not matter) one key a step (jobs_concurrency_key: a key with many waiting jobs costs
    -- one step); only for a tenant with a job to hold for a key that waits for nothing yet.
    SELECT o.tenant_id, (
        WITH RECURSIVE k AS (
            (SELECT w.concurrency_key AS key, 1 AS n FROM jobs w
             WHERE w.tenant_id = o.tenant_id AND w.concurrency_key IS NOT NULL
               AND w.waiting_reason = 'concurrency_key' AND w.status IN ('queued', 'retrying')
             ORDER BY w.concurrency_key LIMIT 1)
            UNION ALL
            SELECT nx.key, k.n + 1
            FROM k, LATERAL (SELECT w.concurrency_key AS key FROM jobs w
                             WHERE w.tenant_id = o.tenant_id AND w.concurrency_key > k.key
                               AND w.waiting_reason = 'concurrency_key'
                               AND w.status IN ('queued', 'retrying')
                             ORDER BY w.concurrency_key LIMIT 1) nx
            WHERE k.n < %(waiting_max)s::int
        )
        SELECT count(*) FROM k
    ) AS waiting
    FROM (SELECT DISTINCT tenant_id FROM over WHERE NOT key_waits) o
), placed AS (
    SELECT o.*,
           CASE WHEN o.key_waits
                  OR k.waiting + dense_rank() OVER (PARTITION BY o.tenant_id, o.key_waits
                                                    ORDER BY o.key) <= %(waiting_max)s::int
                THEN 'concurrency_key' ELSE 'concurrency_keys_waiting' END AS reason
    FROM over o LEFT JOIN tenant_keys k ON k.tenant_id = o.tenant_id
), admitted AS (
    UPDATE jobs j SET key_admitted_at = now(), waiting_reason = NULL
    FROM ranked r WHERE j.id = r.id AND r.used + r.n <= r.lim
    RETURNING j.id
), held AS (
    UPDATE jobs j SET waiting_reason = p.reason, key_admitted_at = NULL,
                      updated_at = CASE WHEN p.old_reason IS DISTINCT FROM p.reason
                                        THEN now() ELSE j.updated_at END
    FROM placed p WHERE j.id = p.id
    RETURNING j.id, p.key, p.lim, p.used, p.attempt, p.old_reason, p.reason
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'waiting', attempt,
           CASE WHEN reason = 'concurrency_key'
                THEN jsonb_build_object('reason', reason, 'key', key, 'limit', lim,
                                        'in_flight', used)
                ELSE jsonb_build_object('reason', reason, 'key', key,
                                        'max_waiting_keys', %(waiting_max)s::int)
           END
    FROM held WHERE old_reason IS DISTINCT FROM reason
)
SELECT id, reason FROM held;

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
    -- Per key, its oldest waiting jobs up to a pass's limit (no more can go in one pass):
    -- read through the key's index, never a scan of every waiting job.
    SELECT w.id, r.used,
           coalesce((%(limits)s::jsonb ->> w.workflow)::int, 2147483647) AS lim,
           row_number() OVER (PARTITION BY r.tenant_id, r.key
                              ORDER BY w.created_at, w.id) AS n
    FROM room r,
         LATERAL (SELECT j.id, j.workflow, j.created_at FROM jobs j
                  WHERE j.tenant_id = r.tenant_id AND j.concurrency_key = r.key
                    AND j.waiting_reason = 'concurrency_key'
                    AND j.status IN ('queued', 'retrying')
                    AND j.workflow = ANY(%(known)s::text[])
                  ORDER BY j.created_at, j.id
                  LIMIT %(limit)s) w
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

-- name: concurrency_promote_overflow
-- The jobs that waited behind their tenant's keys (concurrency_keys_waiting: its jobs
-- waited for waiting_max keys already) take the places its keys left: oldest first, as
-- many per tenant as it has room for waiting keys now, %(limit)s at most in all, they wait
-- for their own keys (reason concurrency_key; the event is written), and a later pass
-- releases them as their keys have room. Not re-published: admitting one now could pass
-- its key's limit (its key is not locked here), and sending it back through admission
-- only to wait again would cost a message each time a place frees. Returns how many.
-- The tenants are found one after another in jobs_keys_waiting (migration 0052: a loose
-- index scan), so a tenant with many such jobs costs one step.
WITH RECURSIVE tenants AS (
    (SELECT j.tenant_id FROM jobs j
     WHERE j.waiting_reason = 'concurrency_keys_waiting' AND j.status IN ('queued', 'retrying')
     ORDER BY j.tenant_id LIMIT 1)
    UNION ALL
    SELECT nx.tenant_id
    FROM tenants t,
         LATERAL (SELECT j.tenant_id FROM jobs j
                  WHERE j.waiting_reason = 'concurrency_keys_waiting'
                    AND j.status IN ('queued', 'retrying') AND j.tenant_id > t.tenant_id
                  ORDER BY j.tenant_id LIMIT 1) nx
), room AS (
    SELECT t.tenant_id, %(waiting_max)s::int - (
        WITH RECURSIVE k AS (
            (SELECT w.concurrency_key AS key, 1 AS n FROM jobs w
             WHERE w.tenant_id = t.tenant_id AND w.concurrency_key IS NOT NULL
               AND w.waiting_reason = 'concurrency_key' AND w.status IN ('queued', 'retrying')
             ORDER BY w.concurrency_key LIMIT 1)
            UNION ALL
            SELECT nx.key, k.n + 1
            FROM k, LATERAL (SELECT w.concurrency_key AS key FROM jobs w
                             WHERE w.tenant_id = t.tenant_id AND w.concurrency_key > k.key
                               AND w.waiting_reason = 'concurrency_key'
                               AND w.status IN ('queued', 'retrying')
                             ORDER BY w.concurrency_key LIMIT 1) nx
            WHERE k.n < %(waiting_max)s::int
        )
        SELECT count(*) FROM k
    ) AS free
    FROM tenants t
), chosen AS (
    SELECT c.id
    FROM room r,
         LATERAL (SELECT j.id FROM jobs j
                  WHERE j.tenant_id = r.tenant_id
                    AND j.waiting_reason = 'concurrency_keys_waiting'
                    AND j.status IN ('queued', 'retrying')
                  ORDER BY j.created_at, j.id
                  LIMIT r.free) c
    WHERE r.free > 0
    LIMIT %(limit)s
), locked AS (
    SELECT j.id FROM jobs j JOIN chosen c ON c.id = j.id
    WHERE j.waiting_reason = 'concurrency_keys_waiting' AND j.status IN ('queued', 'retrying')
    ORDER BY j.id
    FOR UPDATE OF j SKIP LOCKED
), moved AS (
    UPDATE jobs j SET waiting_reason = 'concurrency_key', updated_at = now()
    FROM locked l WHERE j.id = l.id
    RETURNING j.id, j.attempt, j.concurrency_key AS key
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'waiting', attempt,
           jsonb_build_object('reason', 'concurrency_key', 'key', key) FROM moved
)
SELECT count(*) AS n FROM moved;
