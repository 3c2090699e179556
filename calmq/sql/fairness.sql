-- Fair share inside a queue (calmq/data/fairness.py, migration 0044): while a queue (pool and
-- priority) is contended, a worker holds the new jobs it cannot start now in queued with
-- waiting_reason 'fair_share' (the waiting room), and fills each slot that frees from it:
-- the tenant furthest below its weighted share of the queue's running jobs first.

-- name: fair_share_hold
-- Jobs of ids that are waiting (queued, or retrying and due) join the waiting room. The
-- event is written once, when a job starts to wait for this reason at its step and attempt
-- (waited_for, migration 0048: not again after a pick or a stale release took it out of the
-- room and it came back without running); updated_at moves on at every hold, so the stale
-- pass below leaves a job held again alone for another grace.
WITH target AS (
    SELECT id, waited_for AS old_wait, format('fair_share %%s %%s', step, attempt) AS wait
    FROM jobs
    WHERE id = ANY(%(ids)s) AND status IN ('queued', 'retrying')
    ORDER BY id
    FOR UPDATE
), held AS (
    -- key_admitted_at: a place its concurrency key gave it is given back while it waits
    UPDATE jobs j SET waiting_reason = 'fair_share', waited_for = t.wait,
                      key_admitted_at = NULL, updated_at = now()
    FROM target t WHERE j.id = t.id
    RETURNING j.id, j.attempt, j.pool, j.priority, t.old_wait, t.wait
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'waiting', attempt,
           jsonb_build_object('reason', 'fair_share', 'pool', pool, 'priority', priority)
    FROM held WHERE old_wait IS DISTINCT FROM wait
)
SELECT id FROM held;

-- name: fair_share_waiting
-- Whether the queue's waiting room holds a job (one probe of jobs_fair_waiting, migration
-- 0061): a worker that holds none of an interactive room's jobs itself looks before it
-- picks from it, for another worker's holds. A pick keeps the queue's free slots for what
-- it may take while it runs, so a pick of an empty room on every tick sent the queue's
-- arrivals to the room meanwhile (bench priority).
SELECT calmq_fair_next_tenant(%(pool)s, %(priority)s, NULL) IS NOT NULL AS waiting;

-- name: fair_share_pick
-- Up to %(limit)s jobs of the queue's waiting room, fairest first, taken out of it (the caller
-- claims them next). A picked job waits with the reason fair_share_picked until its claim:
-- one whose worker died before it, or could not claim it, goes back into the room after a
-- lease (fair_share_return_picked below). The order
-- is weighted fair queuing on the queue's running jobs: a tenant's k-th waiting job (oldest
-- first) would bring it to (running + k) / weight, and the smallest goes first, so a tenant
-- alone takes every slot, an idle tenant's share goes to the busy ones, and two busy tenants
-- of weights 1 and 3 settle at a quarter and three quarters of the queue's slots. The waiting
-- tenants are found by a skip scan of jobs_fair_waiting (one probe each), then at most
-- %(limit)s jobs each: a pass reads a few rows per tenant, not the whole room. Both reads
-- are functions bound to that index (migration 0061): written here, the planner read a
-- tenant's room through another index and sorted it whenever the statistics predated the
-- backlog (20-25 ms a pick at 30,000 waiting, against 3). Two workers picking at once take
-- different jobs (SKIP LOCKED).
WITH RECURSIVE waiting_tenants AS (
    SELECT calmq_fair_next_tenant(%(pool)s, %(priority)s, NULL) AS tenant_id
    UNION ALL
    SELECT calmq_fair_next_tenant(%(pool)s, %(priority)s, w.tenant_id)
    FROM waiting_tenants w WHERE w.tenant_id IS NOT NULL
), running AS (
    SELECT tenant_id, count(*) AS n FROM jobs
    WHERE status = 'running' AND pool = %(pool)s AND priority = %(priority)s
    GROUP BY tenant_id
), candidates AS (
    SELECT c.id, c.created_at, (coalesce(r.n, 0) + c.k) / coalesce(t.weight, 1) AS share_after
    FROM waiting_tenants w
    LEFT JOIN tenants t ON t.id = w.tenant_id
    LEFT JOIN running r ON r.tenant_id = w.tenant_id
    CROSS JOIN LATERAL (
        SELECT o.id, o.created_at, row_number() OVER (ORDER BY o.created_at, o.id) AS k
        FROM calmq_fair_oldest(%(pool)s, %(priority)s, w.tenant_id, %(limit)s) o
    ) c
    WHERE w.tenant_id IS NOT NULL
), level AS (
    -- The queue's fair level: its running jobs and the slots this pick fills, per unit of
    -- weight of the tenants running or waiting in it. A candidate at or under it takes no
    -- more than its weighted share.
    SELECT (coalesce((SELECT sum(n) FROM running), 0) + %(limit)s)
           / coalesce(sum(coalesce(t.weight, 1)), 1) AS per_weight
    FROM (SELECT tenant_id FROM running UNION SELECT tenant_id FROM waiting_tenants) a
    LEFT JOIN tenants t ON t.id = a.tenant_id
    WHERE a.tenant_id IS NOT NULL
), top AS (
    -- The fairest %(limit)s, but the last %(headroom)s slots only for a candidate within its
    -- share: a tenant above it leaves them free while another tenant runs or waits, so that
    -- tenant's next job finds a slot at once, not when the next one frees (all of a
    -- backlog's calls started together end together: in waves, seconds apart). A tenant
    -- alone is within its share of every slot; the order makes those within a prefix.
    SELECT c.id, c.turn
    FROM (SELECT c.id, c.share_after,
                 row_number() OVER (ORDER BY c.share_after, c.created_at, c.id) AS turn
          FROM candidates c) c
    CROSS JOIN level
    WHERE c.turn <= %(limit)s
      AND (c.turn <= %(limit)s - %(headroom)s OR c.share_after <= level.per_weight)
), chosen AS (
    -- Each candidate is locked through its key alone (OFFSET 0 keeps the lookup a probe of
    -- jobs_pkey per candidate; SKIP LOCKED: another worker's pick has it), then checked
    -- still waiting as it is now. Joined to jobs by the waiting-room filter instead, the
    -- planner read the whole room once per candidate whenever the statistics still showed
    -- the room empty, as after a sudden backlog (1.1 s a pick at 60,000 waiting, 18 s for
    -- 500: the longcalls stall).
    -- Only the top ones are locked (a lock is a row write); one another worker took
    -- meanwhile is skipped, and the fill goes round again for its slot.
    SELECT l.id, top.turn
    FROM top
    CROSS JOIN LATERAL (
        SELECT j.id, j.waiting_reason, j.status FROM jobs j WHERE j.id = top.id
        OFFSET 0
        FOR UPDATE SKIP LOCKED
    ) l
    WHERE l.waiting_reason = 'fair_share' AND l.status IN ('queued', 'retrying')
), resumed AS (
    -- By key (= ANY of the chosen ids): the planner's guess of how many were chosen, from
    -- the tenants' probes, once made it join them to a sequential scan of jobs.
    UPDATE jobs j SET waiting_reason = 'fair_share_picked', updated_at = now()
    WHERE j.id = ANY (ARRAY(SELECT c.id FROM chosen c))
    RETURNING j.id, j.step, j.workflow, j.tenant_id, j.attempt
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'resumed', attempt, '{"reason": "fair_share"}'::jsonb FROM resumed
)
-- Fairest first: the worker starts the picked attempts in this order, and a wave of a
-- few hundred takes ~200 ms to start on one event loop, so the small tenant's job a slot
-- freed for goes out first, not after the backlog's jobs (whose ids sort before it).
-- A last row with no id says the room holds more than this pick took (the headroom, or
-- another worker's lock, left some): the queue stays contended.
SELECT r.id, r.step, r.workflow, r.tenant_id, c.turn
FROM resumed r JOIN chosen c ON c.id = r.id
UNION ALL
SELECT NULL, NULL, NULL, NULL, NULL
WHERE (SELECT count(*) FROM candidates) > (SELECT count(*) FROM chosen)
ORDER BY turn NULLS LAST;

-- name: fair_share_release_stale
-- The safety net (every worker's and `calmq reaper`'s housekeeping): a job in a waiting
-- room that nobody held again or picked for the grace (a fleet that turned fair share off,
-- or whose every worker of the pool stopped) gets a fresh job.requested (the caller writes
-- it in this transaction). A fleet with fair share on holds it again on arrival.
WITH stale AS (
    SELECT id FROM jobs
    WHERE waiting_reason = 'fair_share' AND status IN ('queued', 'retrying')
      AND updated_at < now() - make_interval(secs => %(grace_seconds)s)
    ORDER BY updated_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), moved AS (
    UPDATE jobs j SET waiting_reason = NULL, updated_at = now()
    FROM stale s WHERE j.id = s.id
    RETURNING {{job_row}}, j.status AS old_status
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'resumed', attempt, '{"reason": "fair_share_stale"}'::jsonb FROM moved
)
SELECT * FROM moved;

-- name: fair_share_return_picked
-- The reaper's pass (every worker's and `calmq reaper`'s): a job picked out of a waiting
-- room and not claimed within %(grace_seconds)s (its worker was killed between the pick and
-- the claim, or lost the database meanwhile) goes back into its room, where any worker of
-- the queue picks it; no message carries it, so nothing else would. No event: it waits
-- again for the same step and attempt (fair_share_hold writes a waiting event once).
WITH lost AS (
    SELECT id FROM jobs
    WHERE waiting_reason = 'fair_share_picked' AND status IN ('queued', 'retrying')
      AND updated_at < now() - make_interval(secs => %(grace_seconds)s)
    ORDER BY updated_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE jobs j SET waiting_reason = 'fair_share', updated_at = now()
FROM lost l WHERE j.id = l.id
RETURNING j.id, j.pool, j.priority;

-- name: set_tenant_weight
UPDATE tenants SET weight = %(weight)s WHERE name = %(name)s RETURNING id;
