-- Review caps (calmq/data/review_caps.py): past its cap, a pool's new jobs that can end in
-- review wait in queued (event waiting, reason review_cap) instead of piling up reviews;
-- the release pass re-publishes them as decided reviews free room under the cap.

-- name: review_capped_pools
-- The pools that have a cap: the worker caches these (a batch of other pools costs nothing).
SELECT pool, cap FROM review_caps;

-- name: lock_review_caps
-- The caps of a claim batch's pools, locked in pool order in a statement of their own, in
-- the transaction of hold_for_review_cap: that statement's count then sees what the other
-- holds and releases of these pools committed while this lock waited. (A lock taken inside
-- the counting statement does not: in READ COMMITTED the statement keeps the snapshot it
-- started with, and two holds that met at the lock both counted the last room as free.)
SELECT c.pool FROM review_caps c
WHERE c.pool IN (SELECT pool FROM jobs WHERE id = ANY(%(ids)s))
ORDER BY c.pool
FOR UPDATE OF c;

-- name: lock_all_review_caps
-- Every cap, locked in pool order before release_review_cap_holds counts (as above).
SELECT pool FROM review_caps ORDER BY pool FOR UPDATE;

-- name: hold_for_review_cap
-- Of a claim batch's jobs (ids: jobs of workflows that can end in review), hold the queued
-- ones never claimed that would take their pool past its cap, and mark the ones let through
-- (review_cap_released_at, as the release pass marks what it lets go): they count from
-- this statement on, not from their claim. Used: the pool's pending reviews, its claimed
-- jobs of those workflows not in review yet (running, between steps, retrying), and the jobs
-- this statement or the release pass let through that are not in review yet (besides this
-- batch). Counted only from their claim, a job let through was invisible to the release
-- pass (another task) and to another worker's hold until then, and each let one more job
-- go past the cap (CI: three reviews pending under a cap of two, and a job released twice).
-- The cap row is locked so that the fleet's holds of one pool take turns. The event's
-- pending: the reviews pending or on their way (running, or ahead of it in this batch)
-- when it was held. Returns every job held (newly or again); only a new hold writes the
-- event, so a held job the sweeper re-publishes does not grow its history.
WITH caps AS (
    SELECT c.pool, c.cap FROM review_caps c
    WHERE c.pool IN (SELECT pool FROM jobs WHERE id = ANY(%(ids)s))
    ORDER BY c.pool
    FOR UPDATE OF c
), used AS (
    SELECT c.pool, c.cap, (
        SELECT count(*) FROM jobs j
        WHERE j.pool = c.pool AND NOT (j.id = ANY(%(ids)s))
          AND (j.status = 'awaiting_review'
               -- admitted (claimed once) and on its way: running, between two steps, or
               -- waiting for a retry
               OR (j.status IN ('running', 'queued', 'retrying') AND j.lease_version > 0
                   AND j.workflow = ANY(%(workflows)s::text[]))
               OR (j.status IN ('queued', 'retrying') AND j.review_cap_released_at IS NOT NULL
                   AND j.review_cap_held_at IS NULL))) AS used
    FROM caps c
), locked AS (
    SELECT j.id, j.pool, j.created_at, j.review_cap_held_at FROM jobs j
    -- Only a job never claimed is held: one admitted earlier (at its next step, or retrying)
    -- already counts against the cap and goes on to its review.
    WHERE j.id = ANY(%(ids)s) AND j.status = 'queued' AND j.lease_version = 0
    ORDER BY j.id
    FOR UPDATE OF j
), ranked AS (
    -- Jobs released before (or never held) go first, then oldest first.
    SELECT l.id, l.review_cap_held_at AS was_held, u.cap, u.used,
           row_number() OVER (PARTITION BY l.pool
                              ORDER BY l.review_cap_held_at NULLS FIRST, l.created_at, l.id) AS n
    FROM locked l JOIN used u ON u.pool = l.pool
), held AS (
    -- a job picked from a fair-share waiting room waits for the cap now, not for its claim
    UPDATE jobs j SET review_cap_held_at = COALESCE(j.review_cap_held_at, now()),
                      review_cap_released_at = NULL, updated_at = now(),
                      waiting_reason = NULLIF(j.waiting_reason, 'fair_share_picked')
    FROM ranked r WHERE j.id = r.id AND r.n > r.cap - r.used
    RETURNING j.id, j.pool, j.attempt, r.was_held, r.cap, r.used + r.n - 1 AS used
), admitted AS (
    -- a job held before and let through here (its message came again, the sweeper's) says
    -- so in its history, as one the release pass lets go does
    UPDATE jobs j SET review_cap_held_at = NULL, review_cap_released_at = now()
    FROM ranked r WHERE j.id = r.id AND r.n <= r.cap - r.used
    RETURNING j.id, j.attempt, r.was_held
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'waiting', attempt,
           jsonb_build_object('reason', 'review_cap', 'pool', pool, 'cap', cap,
                              'pending', used)
    FROM held WHERE was_held IS NULL
    UNION ALL
    SELECT id, 'resumed', attempt, jsonb_build_object('reason', 'review_cap')
    FROM admitted WHERE was_held IS NOT NULL
)
SELECT id FROM held;

-- name: release_review_cap_holds
-- The release pass: per pool, as many held jobs (oldest hold first) as there is room under
-- its cap: the cap less what the hold counts as used (hold_for_review_cap): its pending
-- reviews, its admitted jobs of the workflows that can end in review (%(workflows)s) not
-- in review yet, and the jobs released earlier that are not in review yet. A pool whose cap
-- was removed releases them all. The caller re-publishes each (job.requested through the
-- outbox) in the same transaction. (Counting less than the hold does released held jobs
-- while the jobs admitted before them were still running, only for the worker to hold
-- them again: a second waiting event, and a needless round trip through Kafka.)
WITH caps AS (
    SELECT c.pool, c.cap FROM review_caps c ORDER BY c.pool FOR UPDATE OF c
), room AS (
    SELECT p.pool, CASE WHEN c.cap IS NULL THEN NULL ELSE c.cap - (
        SELECT count(*) FROM jobs j
        WHERE j.pool = p.pool
          AND (j.status = 'awaiting_review'
               OR (j.status IN ('running', 'queued', 'retrying') AND j.lease_version > 0
                   AND j.workflow = ANY(%(workflows)s::text[]))
               OR (j.status IN ('queued', 'retrying', 'running')
                   AND j.review_cap_released_at IS NOT NULL AND j.review_cap_held_at IS NULL)))
    END AS room
    FROM (SELECT DISTINCT pool FROM jobs WHERE review_cap_held_at IS NOT NULL) p
    LEFT JOIN caps c ON c.pool = p.pool
), ranked AS (
    SELECT j.id, r.room,
           row_number() OVER (PARTITION BY j.pool ORDER BY j.review_cap_held_at, j.id) AS n
    FROM jobs j JOIN room r ON r.pool = j.pool
    WHERE j.review_cap_held_at IS NOT NULL AND j.status = 'queued'
), chosen AS (
    SELECT j.id FROM jobs j JOIN ranked r ON r.id = j.id
    WHERE r.room IS NULL OR r.n <= r.room
    ORDER BY j.id
    LIMIT %(limit)s
    FOR UPDATE OF j SKIP LOCKED
), released AS (
    UPDATE jobs j SET review_cap_held_at = NULL, review_cap_released_at = now(),
                      updated_at = now()
    FROM chosen c WHERE j.id = c.id AND j.status = 'queued'
    -- read as calmq.data.jobs.Job, like claim_jobs' rows
    RETURNING {{job_row}}, 'queued'::text AS old_status
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'resumed', attempt, jsonb_build_object('reason', 'review_cap') FROM released
)
SELECT * FROM released;

-- name: review_cap_held
-- How many jobs wait for each pool's cap (the console's overview).
SELECT pool, count(*) AS held FROM jobs
WHERE review_cap_held_at IS NOT NULL AND status = 'queued'
GROUP BY pool;
