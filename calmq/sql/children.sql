-- Child jobs and their join (calmq/data/children.py, migration 0053). The join itself is
-- decided by the trigger calmq_settle_child, in the transaction that settles a child (once
-- per statement and join row since migration 0058).

-- name: children_ancestors
-- How many ancestors a job has (its nesting depth: 0 for a job nobody started), counted up
-- to %(limit)s: a step may start children only below the depth limit.
WITH RECURSIVE up AS (
    SELECT parent_id, 1 AS d FROM jobs WHERE id = %(id)s
    UNION ALL
    SELECT j.parent_id, u.d + 1 FROM jobs j JOIN up u ON j.id = u.parent_id
    WHERE u.d <= %(limit)s
)
SELECT count(*) AS n FROM up WHERE parent_id IS NOT NULL;

-- name: children_cancelled_with
-- The descendants the cancel of %(id)s cancelled in this transaction, at every level (the
-- trigger calmq_cascade_parent, migration 0053: their rows carry this transaction's id as
-- xmin): the caller writes each one's job.result, as for the job itself, so that a consumer
-- of the results topic sees every child end. One that had ended before keeps its own.
WITH RECURSIVE tree AS (
    SELECT id FROM jobs WHERE parent_id = %(id)s
    UNION ALL
    SELECT j.id FROM jobs j JOIN tree t ON j.parent_id = t.id
)
SELECT j.id, j.tenant_id, j.workflow, j.step, j.attempt, j.trace_parent, j.parent_id,
       j.metadata, j.workflow_version
FROM tree t JOIN jobs j ON j.id = t.id
WHERE j.status = 'cancelled' AND j.xmin = pg_current_xact_id()::xid;

-- name: insert_children
-- A spawning step's children (rows as a JSON array), their first history event and their
-- job.requested, in the group commit's transaction after finish_attempts: only while that
-- statement has just moved the parent to wait for them (a fenced finish moved nothing, and
-- starts nothing). Same columns as insert_jobs, plus parent_id and child_index; a child
-- past the in-flight limit (held) waits (parent_in_flight) with its event in
-- job_held_children instead of the outbox.
WITH parent AS (
    SELECT id FROM jobs
    WHERE id = %(parent_id)s AND status = 'queued' AND waiting_reason = 'children'
), src AS (
    SELECT r.* FROM parent, jsonb_to_recordset(%(jobs)s::jsonb) AS r(
        id uuid, tenant_id uuid, workflow text, workflow_version integer, priority text,
        pool text, step text, max_attempts integer, input jsonb, metadata jsonb,
        deadline_at timestamptz, trace_parent text, lane text, concurrency_key text,
        child_index integer, held boolean, event_id uuid, route text, payload jsonb,
        headers jsonb)
), job AS (
    INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority, pool, step,
                      max_attempts, input, metadata, deadline_at, trace_parent, lane,
                      concurrency_key, parent_id, child_index, parent_step, waiting_reason)
    SELECT id, tenant_id, workflow, workflow_version, 'queued', priority, pool, step,
           max_attempts, input, COALESCE(metadata, '{}'), deadline_at, trace_parent,
           COALESCE(lane, 'online'), concurrency_key, %(parent_id)s, child_index, %(step)s,
           CASE WHEN held THEN 'parent_in_flight' END
    FROM src
    RETURNING id, created_at
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'queued', 0, jsonb_build_object('parent_id', %(parent_id)s::text) FROM job
), held AS (
    -- past the in-flight limit: released one by one as earlier children end
    INSERT INTO job_held_children (job_id, parent_id, child_index, route, payload, headers)
    SELECT s.id, %(parent_id)s, s.child_index, s.route, s.payload, COALESCE(s.headers, '{}')
    FROM src s WHERE s.held
)
INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers)
SELECT s.event_id, s.route, j.id::text, 'job.requested',
       s.payload || jsonb_build_object(
           'created_at', floor(extract(epoch FROM j.created_at) * 1000)::bigint),
       COALESCE(s.headers, '{}')
FROM job j JOIN src s ON s.id = j.id
WHERE NOT s.held;

-- name: insert_join
-- The parent's join record, beside its children (same transaction). A step that spawns
-- again (a redrive, a later step) replaces its row.
INSERT INTO job_joins (parent_id, step, policy, k, n, resume_outbox, fail_outbox)
SELECT %(parent_id)s, %(step)s, %(policy)s, %(k)s, %(n)s, %(resume_outbox)s, %(fail_outbox)s
WHERE EXISTS (SELECT 1 FROM jobs WHERE id = %(parent_id)s AND status = 'queued'
                                   AND waiting_reason = 'children')
ON CONFLICT (parent_id, step) DO UPDATE
    SET policy = EXCLUDED.policy, k = EXCLUDED.k, n = EXCLUDED.n, succeeded = 0, failed = 0,
        resume_outbox = EXCLUDED.resume_outbox, fail_outbox = EXCLUDED.fail_outbox,
        created_at = now(), fired_at = NULL, outcome = NULL;

-- name: children_outcomes
-- What the parent's next step receives: each child its step started (step NULL: every
-- step's), in input order, with its status and its artifact (a reference) or its error.
SELECT id, child_index, status, artifact, error FROM jobs
WHERE parent_id = %(parent_id)s
  AND (%(step)s::text IS NULL OR parent_step = %(step)s::text)
ORDER BY child_index;

-- name: children_next_index
-- Where a spawn's child indexes start: after every earlier spawn's of the same parent (a
-- job's children are numbered across its steps, so its page of children has one order).
SELECT COALESCE(max(child_index) + 1, 0) AS n FROM jobs WHERE parent_id = %(parent_id)s;

-- name: children_page
-- A page of a tenant's job's children, in input order, after the cursor (the last
-- child_index of the previous page; -1 from the first).
SELECT c.id, c.child_index, c.workflow, c.status, c.attempt, c.step, c.artifact, c.error,
       c.created_at, c.updated_at
FROM jobs c
WHERE c.parent_id = %(parent_id)s AND c.tenant_id = %(tenant_id)s
  AND c.child_index > %(after)s
ORDER BY c.child_index
LIMIT %(limit)s;

-- name: children_counts
-- A job's children by status, and its joins (newest first).
SELECT (SELECT COALESCE(jsonb_object_agg(status, n), '{}'::jsonb)
        FROM (SELECT status, count(*) AS n FROM jobs
              WHERE parent_id = %(parent_id)s AND tenant_id = %(tenant_id)s
              GROUP BY status) s) AS counts,
       (SELECT COALESCE(jsonb_agg(jsonb_build_object(
                   'step', step, 'policy', policy, 'k', k, 'n', n, 'succeeded', succeeded,
                   'failed', failed, 'fired_at', fired_at, 'outcome', outcome)
                   ORDER BY created_at DESC), '[]'::jsonb)
        FROM job_joins WHERE parent_id = %(parent_id)s) AS joins,
       (SELECT parent_id FROM jobs WHERE id = %(parent_id)s) AS parent_id;

-- name: children_rearm
-- A redriven parent whose last join failed (in dlq_requeue's transaction, after it): the
-- join is armed again with what its children did so far: those that succeeded keep their
-- outputs and are not run again, those still running count when they end, a cancelled one
-- stays cancelled and counts as failed; the dead-lettered ones run again
-- (children_requeue_failed). The parent waits for the join instead of running its next
-- step. Returns the join as armed; no row: the parent had no failed join (an ordinary
-- redrive).
WITH j AS (
    SELECT parent_id, step FROM job_joins
    WHERE parent_id = %(id)s AND outcome = 'failed'
    ORDER BY created_at DESC LIMIT 1
    FOR UPDATE
), parent AS (
    UPDATE jobs p SET waiting_reason = 'children'
    FROM j WHERE p.id = j.parent_id AND p.status = 'queued'
    RETURNING p.id
)
UPDATE job_joins jj
SET succeeded = (SELECT count(*) FROM jobs c
                 WHERE c.parent_id = jj.parent_id AND c.parent_step = jj.step
                   AND c.status = 'completed'),
    failed = (SELECT count(*) FROM jobs c
              WHERE c.parent_id = jj.parent_id AND c.parent_step = jj.step
                AND c.status = 'cancelled'),
    fired_at = NULL, outcome = NULL
FROM j, parent
WHERE jj.parent_id = j.parent_id AND jj.step = j.step
RETURNING jj.step, jj.policy, jj.k, jj.n, jj.succeeded, jj.failed;

-- name: children_hold_settling
-- A redriven parent's children that have not ended (and are not held), locked in id order
-- (the order finish_attempts and claim lock jobs in) before the join is re-armed and the
-- failed ones are queued again: a child ends only after this transaction commits, so its
-- settle (calmq_settle_child) sees the re-armed join and the children this redrive held,
-- and releases the next of them. Without it, the last children in flight could end between
-- children_requeue_failed's count and the commit, releasing nothing (the held rows not
-- committed yet), and leave the held ones waiting for ever; and a child ending meanwhile
-- would be missed by children_rearm's count. A job with no children reads one index entry.
SELECT c.id FROM jobs c
WHERE c.parent_id = %(id)s AND c.status NOT IN ('completed', 'dead_letter', 'cancelled')
  AND c.waiting_reason IS DISTINCT FROM 'parent_in_flight'
ORDER BY c.id
FOR SHARE;

-- name: children_requeue_failed
-- The re-armed join's dead-lettered children queued again from the step they failed at,
-- each with the history saying why; the caller writes their job.requested in this
-- transaction. The whole rows: job.requested is filled from them. Their attempts are kept
-- aside by round, as dlq_requeue keeps a redriven job's (the new round's attempts start at
-- 1 again). As at a spawn (insert_children), at most in_flight (children_in_flight_max)
-- of the parent's children are in flight: those still running count, and the failed ones
-- past the room left wait (parent_in_flight, in input order) for the caller to put their
-- job.requested in job_held_children (children_hold_requeued), released one by one as
-- earlier children end.
WITH running AS (
    SELECT count(*) AS n FROM jobs c
    WHERE c.parent_id = %(id)s AND c.status NOT IN ('completed', 'dead_letter', 'cancelled')
      AND c.waiting_reason IS DISTINCT FROM 'parent_in_flight'
), failed AS (
    SELECT c.id, row_number() OVER (ORDER BY c.child_index) AS k FROM jobs c
    WHERE c.parent_id = %(id)s AND c.parent_step = %(step)s AND c.status = 'dead_letter'
      AND c.redacted_at IS NULL
), again AS (
    UPDATE jobs c SET status = 'queued', attempt = 0, error = NULL,
                      waiting_reason = CASE WHEN f.k > GREATEST(%(in_flight)s - r.n, 0)
                                            THEN 'parent_in_flight' END,
                      lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
    FROM failed f, running r
    WHERE c.id = f.id AND c.status = 'dead_letter'
    RETURNING c.*
), round AS (
    SELECT a.id, (SELECT count(*) + 1 FROM job_events e
                  WHERE e.job_id = a.id AND e.at >= a.created_at AND e.type = 'redriven') AS n
    FROM again a
), archived AS (
    DELETE FROM job_attempts t USING again a
    WHERE t.job_id = a.id AND t.started_at >= a.created_at
    RETURNING t.*
), kept AS (
    INSERT INTO job_attempts_redriven (job_id, round, step, attempt, record)
    SELECT t.job_id, r.n, t.step, t.attempt, to_jsonb(t) - 'job_id'
    FROM archived t JOIN round r ON r.id = t.job_id
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT a.id, 'redriven', 0, jsonb_build_object('by', 'parent', 'parent_id', %(id)s::text,
                                                   'round', r.n)
    FROM again a JOIN round r ON r.id = a.id
)
SELECT * FROM again ORDER BY child_index;

-- name: children_hold_requeued
-- The redriven children past the in-flight limit (children_requeue_failed): their
-- job.requested (rows as a JSON array) waits here as a spawn's held children's do, and
-- calmq_settle_child releases them in input order as earlier children end.
INSERT INTO job_held_children (job_id, parent_id, child_index, route, payload, headers)
SELECT r.job_id, %(parent_id)s, r.child_index, r.route, r.payload, COALESCE(r.headers, '{}')
FROM jsonb_to_recordset(%(rows)s::jsonb)
     AS r(job_id uuid, child_index integer, route text, payload jsonb, headers jsonb);

-- name: children_cancel_tree
-- Every descendant of %(id)s (the tenant's, at every level) that has not ended, cancelled
-- in one statement when the job is deleted (producers.retention.purge), each with its
-- history saying why; the caller writes their job.result (children_results) in this
-- transaction. The rows are locked in id order first, as finish_attempts and claim lock
-- jobs, so a group commit finishing some of them waits rather than deadlocks. The cascade
-- (calmq_cascade_parent) then finds their children cancelled already and closes their
-- joins; calmq_settle_child counts them once per join and drops the held ones' rows.
WITH RECURSIVE tree AS (
    SELECT id FROM jobs WHERE parent_id = %(id)s AND tenant_id = %(tenant_id)s
    UNION ALL
    SELECT j.id FROM jobs j JOIN tree t ON j.parent_id = t.id
    WHERE j.tenant_id = %(tenant_id)s
), locked AS (
    SELECT j.id FROM jobs j JOIN tree t ON t.id = j.id
    WHERE j.status NOT IN ('completed', 'dead_letter', 'cancelled')
    ORDER BY j.id
    FOR UPDATE OF j
), cancelled AS (
    UPDATE jobs j SET status = 'cancelled', lease_owner = NULL, lease_expires_at = NULL,
                      waiting_until = NULL, updated_at = now()
    FROM locked l
    WHERE j.id = l.id AND j.status NOT IN ('completed', 'dead_letter', 'cancelled')
    RETURNING j.id, j.tenant_id, j.workflow, j.step, j.attempt, j.trace_parent, j.parent_id,
              j.metadata, j.workflow_version
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'cancelled', attempt,
           jsonb_build_object('by', %(by)s::text, 'parent_id', parent_id::text)
    FROM cancelled
)
SELECT * FROM cancelled ORDER BY id;

-- name: children_results
-- Outbox rows (a JSON array of OutboxEntry.as_json) in one statement, in their order: the
-- job.result of each child children_cancel_tree cancelled.
INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers)
SELECT r.id, r.route, r.key, r.type, r.payload, r.headers
FROM jsonb_to_recordset(%(rows)s::jsonb)
     AS r(id uuid, route text, key text, type text, payload jsonb, headers jsonb, n integer)
ORDER BY r.n;
