-- Jobs (calmq/data/jobs.py): intake, idempotency, reading, claim, leases, reaping,
-- cancel. The status guards in these WHERE clauses are calmq.jobs' moves
-- (tests/integration/test_job_moves.py holds them to the table).

-- fragment: job_row
-- The columns calmq.data.jobs.Job is read from, of the jobs row named j. Each statement that
-- returns jobs writes it in double braces in its RETURNING or SELECT list and adds old_status
-- itself (the status it found the job in). tests/integration/test_job_row.py runs every such
-- statement and checks that each Job field comes back.
j.id, j.tenant_id, j.workflow, j.workflow_version, j.priority, j.pool, j.step, j.attempt,
j.max_attempts, j.input, j.input_ref, j.metadata, j.deadline_at, j.trace_parent, j.created_at,
j.lease_version, j.lane, j.concurrency_key

-- name: find_idempotency_key
SELECT request_hash, job_id FROM idempotency_keys
WHERE tenant_id = %(tenant_id)s AND key = %(key)s;

-- name: insert_idempotency_key
INSERT INTO idempotency_keys (tenant_id, key, request_hash, job_id)
VALUES (%(tenant_id)s, %(key)s, %(request_hash)s, %(job_id)s);

-- name: find_idempotency_keys
-- A bulk submit's keys, all at once (POST /v1/jobs/bulk). Its arrays, and those of
-- insert_idempotency_keys, are sent in binary (the b placeholders): psycopg writes a text
-- array element by element in Python, and a bytea element's text form escaped once more for
-- the array cost ~50 us of the API's CPU per key, a quarter of a bulk item's.
SELECT key, request_hash, job_id FROM idempotency_keys
WHERE tenant_id = %(tenant_id)s AND key = ANY(%(keys)b::text[]);

-- name: insert_idempotency_keys
-- A bulk submit's new keys in one statement, in the transaction of their jobs.
INSERT INTO idempotency_keys (tenant_id, key, request_hash, job_id)
SELECT %(tenant_id)s, k.key, k.request_hash, k.job_id
FROM unnest(%(keys)b::text[], %(hashes)b::bytea[], %(job_ids)b::uuid[])
     AS k(key, request_hash, job_id);

-- name: insert_job
-- The job row, its first history event and its outbox row in one statement: one round trip.
-- created_at in events is epoch ms TRUNCATED (floor; ::bigint alone would round), the rule
-- calmq.events._ms applies to the same column, so one job's events never disagree by 1 ms.
WITH job AS (
    INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority, pool, step,
                      max_attempts, input, input_ref, metadata, callback_url, deadline_at,
                      trace_parent, lane, concurrency_key)
    VALUES (%(id)s, %(tenant_id)s, %(workflow)s, %(workflow_version)s, 'queued', %(priority)s,
            %(pool)s, %(step)s, %(max_attempts)s, %(input)s, %(input_ref)s, %(metadata)s,
            %(callback_url)s, %(deadline_at)s, %(trace_parent)s, %(lane)s,
            %(concurrency_key)s)
    RETURNING id, created_at
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'queued', 0, '{}'::jsonb FROM job
)
INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers)
SELECT %(event_id)s, %(route)s, id::text, 'job.requested',
       %(payload)s::jsonb || jsonb_build_object(
           'created_at', floor(extract(epoch FROM created_at) * 1000)::bigint),
       %(headers)s
FROM job
RETURNING (SELECT created_at FROM job) AS created_at;

-- name: insert_jobs
-- Group commit: many submits in ONE statement (rows as a JSON array), so a batch costs one
-- parse, plan and execution instead of one per job. Same rows as insert_job writes.
WITH src AS (
    SELECT * FROM jsonb_to_recordset(%(jobs)s::jsonb) AS r(
        id uuid, tenant_id uuid, workflow text, workflow_version integer, priority text,
        pool text, step text, max_attempts integer, input jsonb, input_ref text,
        metadata jsonb, callback_url text, deadline_at timestamptz, trace_parent text,
        lane text, concurrency_key text, event_id uuid, route text, payload jsonb,
        headers jsonb)
), job AS (
    INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority, pool, step,
                      max_attempts, input, input_ref, metadata, callback_url, deadline_at,
                      trace_parent, lane, concurrency_key)
    SELECT id, tenant_id, workflow, workflow_version, 'queued', priority, pool, step,
           max_attempts, input, input_ref, COALESCE(metadata, '{}'), callback_url, deadline_at,
           trace_parent, COALESCE(lane, 'online'), concurrency_key
    FROM src
    RETURNING id, created_at
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'queued', 0, '{}'::jsonb FROM job
)
INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers)
SELECT s.event_id, s.route, j.id::text, 'job.requested',
       s.payload || jsonb_build_object(
           'created_at', floor(extract(epoch FROM j.created_at) * 1000)::bigint),
       COALESCE(s.headers, '{}')
FROM job j JOIN src s ON s.id = j.id;

-- name: job_for_tenant
-- calmq.data.jobs.JobDetail's columns (its events: job_events)
SELECT id, parent_id, workflow, status, attempt, step, artifact, error, created_at, updated_at,
       metadata, input_tokens, output_tokens, cost_usd, waiting_reason, rerun_of,
       cached_input_tokens, cache_write_tokens, cache_saved_usd
FROM jobs WHERE id = %(id)s AND tenant_id = %(tenant_id)s;

-- name: job_events
-- A job's history lies in the time partitions from its creation on (no event is older than
-- its job), so each read of one job's job_events or job_attempts rows names that bound: the
-- partitions before it are never opened (issue 32; docs/explanation/database-at-scale.md).
SELECT h.id, h.type, h.at, h.attempt, h.detail FROM job_events h
WHERE h.job_id = %(id)s AND h.at >= (SELECT k.created_at FROM jobs k WHERE k.id = %(id)s)
ORDER BY h.id;

-- name: list_jobs
-- Newest first; the cursor is the (created_at, id) of the last row of the previous page,
-- which the jobs_tenant_created index serves without an OFFSET scan.
SELECT id, workflow, status, attempt, step, artifact, error, created_at, updated_at,
       metadata
FROM jobs
WHERE tenant_id = %(tenant_id)s
  AND (%(statuses)s::text[] IS NULL OR status = ANY(%(statuses)s::text[]))
  AND (%(workflow)s::text IS NULL OR workflow = %(workflow)s::text)
  AND (%(created_after)s::timestamptz IS NULL OR created_at >= %(created_after)s::timestamptz)
  AND (%(created_before)s::timestamptz IS NULL OR created_at < %(created_before)s::timestamptz)
  AND (%(cursor_at)s::timestamptz IS NULL
       OR (created_at, id) < (%(cursor_at)s::timestamptz, %(cursor_id)s::uuid))
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s;

-- name: list_jobs_by_metadata
-- list_jobs with GET /v1/jobs?metadata.<key>=<value> (issue 43: a backfill followed by its
-- tag). A statement of its own rather than one more "IS NULL OR" arm: a prepared
-- statement's generic plan cannot use an index for an arm that may be switched off, and
-- the containment must be able to use the GIN index jobs_metadata (migration 0031) when the
-- tag is rare; when it is common the planner walks jobs_tenant_created and stops at LIMIT.
SELECT id, workflow, status, attempt, step, artifact, error, created_at, updated_at,
       metadata
FROM jobs
WHERE tenant_id = %(tenant_id)s
  AND metadata @> %(metadata)s::jsonb
  AND (%(statuses)s::text[] IS NULL OR status = ANY(%(statuses)s::text[]))
  AND (%(workflow)s::text IS NULL OR workflow = %(workflow)s::text)
  AND (%(created_after)s::timestamptz IS NULL OR created_at >= %(created_after)s::timestamptz)
  AND (%(created_before)s::timestamptz IS NULL OR created_at < %(created_before)s::timestamptz)
  AND (%(cursor_at)s::timestamptz IS NULL
       OR (created_at, id) < (%(cursor_at)s::timestamptz, %(cursor_id)s::uuid))
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s;

-- name: ops_list_jobs
-- Operators' view (the CLI): every tenant's jobs, list_jobs' filters plus the tenant's name,
-- newest first, after the (created_at, id) cursor of the previous page.
SELECT j.id, j.workflow, j.status, j.attempt, j.step, j.artifact, j.error, j.created_at,
       j.updated_at, j.metadata, j.tenant_id, t.name AS tenant
FROM jobs j JOIN tenants t ON t.id = j.tenant_id
WHERE (%(tenant)s::text IS NULL OR t.name = %(tenant)s::text)
  AND (%(statuses)s::text[] IS NULL OR j.status = ANY(%(statuses)s::text[]))
  AND (%(workflow)s::text IS NULL OR j.workflow = %(workflow)s::text)
  AND (%(created_after)s::timestamptz IS NULL OR j.created_at >= %(created_after)s::timestamptz)
  AND (%(created_before)s::timestamptz IS NULL OR j.created_at < %(created_before)s::timestamptz)
  AND (%(metadata)s::jsonb IS NULL OR j.metadata @> %(metadata)s::jsonb)
  AND (%(cursor_at)s::timestamptz IS NULL
       OR (j.created_at, j.id) < (%(cursor_at)s::timestamptz, %(cursor_id)s::uuid))
ORDER BY j.created_at DESC, j.id DESC
LIMIT %(limit)s;

-- name: ops_count_jobs
-- How many jobs ops_list_jobs would page through from its cursor on.
SELECT count(*) AS n
FROM jobs j JOIN tenants t ON t.id = j.tenant_id
WHERE (%(tenant)s::text IS NULL OR t.name = %(tenant)s::text)
  AND (%(statuses)s::text[] IS NULL OR j.status = ANY(%(statuses)s::text[]))
  AND (%(workflow)s::text IS NULL OR j.workflow = %(workflow)s::text)
  AND (%(created_after)s::timestamptz IS NULL OR j.created_at >= %(created_after)s::timestamptz)
  AND (%(created_before)s::timestamptz IS NULL OR j.created_at < %(created_before)s::timestamptz)
  AND (%(metadata)s::jsonb IS NULL OR j.metadata @> %(metadata)s::jsonb)
  AND (%(cursor_at)s::timestamptz IS NULL
       OR (j.created_at, j.id) < (%(cursor_at)s::timestamptz, %(cursor_id)s::uuid));

-- name: job_tenant
-- Whose job it is (operators act on any tenant's job, by id alone).
SELECT tenant_id FROM jobs WHERE id = %(id)s;

-- name: job_events_after
SELECT h.id, h.type, h.at, h.attempt, h.detail FROM job_events h
WHERE h.job_id = %(id)s AND h.at >= (SELECT k.created_at FROM jobs k WHERE k.id = %(id)s)
  AND h.id > %(after)s
ORDER BY h.id;

-- name: job_status
SELECT status, input_ref, artifact, redacted_at FROM jobs
WHERE id = %(id)s AND tenant_id = %(tenant_id)s;

-- name: claim_jobs
-- Claim every job of a polled batch in one statement. A job is claimable when it is
-- waiting (queued, retrying) or running under an expired lease (its worker died; the
-- history then says requeued_after_restart before the new running event). Each claim moves
-- lease_version on: the fencing token the attempt's writes carry (see heartbeat).
WITH target AS (
    SELECT id, status AS old_status FROM jobs
    WHERE id = ANY(%(ids)s)
      -- a message for a step the job has left behind is stale (multi-step workflows)
      AND (%(steps)s::jsonb IS NULL OR step = %(steps)s::jsonb ->> id::text)
      AND (status IN ('queued', 'retrying')
           OR (status = 'running' AND lease_expires_at < now()
               -- the attempt cap: a job whose last attempt used up its budget and ended
               -- with its worker (killed, out of memory: no outcome) is not run again;
               -- poison_expired_leases dead-letters it (the same test, there)
               AND NOT (attempt >= max_attempts AND NOT EXISTS (
                   SELECT 1 FROM job_attempts a
                   WHERE a.job_id = jobs.id AND a.step = jobs.step AND a.attempt = jobs.attempt
                     AND a.started_at >= jobs.created_at AND a.outcome = 'released'))))
    ORDER BY id
    FOR UPDATE
), claimed AS (
    UPDATE jobs j SET status = 'running', attempt = j.attempt + 1,
                      lease_version = j.lease_version + 1,
                      lease_owner = %(worker)s, waiting_reason = NULL, waiting_until = NULL,
                      -- running counts against its concurrency key by its status now
                      key_admitted_at = NULL,
                      lease_expires_at = now() + make_interval(secs => %(lease_seconds)s),
                      updated_at = now()
    FROM target t WHERE j.id = t.id
    RETURNING {{job_row}}, t.old_status
), attempts AS (
    -- A claim moves the attempt number on, so (job, step, attempt) is new: the two statements
    -- that take an attempt back (provider_hand_back, dlq_requeue) delete or archive its row.
    -- (No ON CONFLICT: job_attempts is partitioned by started_at, and a unique index of a
    -- partitioned table must hold its partition key.)
    INSERT INTO job_attempts (job_id, step, attempt, worker, started_at, lease_version)
    SELECT id, step, attempt, %(worker)s, now(), lease_version FROM claimed
), history AS (
    -- One INSERT, ordered: two data-modifying CTEs run in no set order, and the history
    -- (read in id order) then said running before requeued_after_restart now and then.
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, type, attempt, detail FROM (
        SELECT id, 0 AS seq, 'requeued_after_restart' AS type, attempt - 1 AS attempt,
               '{"reason": "lease_expired"}'::jsonb AS detail
        FROM claimed WHERE old_status = 'running'
        UNION ALL
        SELECT id, 1, 'running', attempt, jsonb_build_object('worker', %(worker)s::text)
        FROM claimed
    ) e
    ORDER BY id, seq
)
SELECT * FROM claimed;

-- name: visible_jobs
-- Which of a batch's unclaimed jobs this session can see: step and status.
SELECT id, step, status FROM jobs WHERE id = ANY(%(ids)s);

-- name: heartbeat
-- Extends the leases of the attempts given as (id, lease_version) pairs: only while the job
-- is still at that version, so an attempt whose lease was taken over (even by the same
-- worker id, restarted) is told it lost it instead of extending its successor's lease.
-- Rows are locked in id order, the order claim and finish use too: concurrent heartbeats,
-- claims and group commits of one worker then never deadlock on each other.
WITH mine AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(versions)s::bigint[]) AS m(id, lease_version)
), held AS (
    SELECT j.id FROM jobs j JOIN mine m ON m.id = j.id AND m.lease_version = j.lease_version
    WHERE j.lease_owner = %(worker)s AND j.status = 'running'
    ORDER BY j.id
    FOR UPDATE OF j
)
UPDATE jobs j SET lease_expires_at = now() + make_interval(secs => %(lease_seconds)s)
FROM held WHERE j.id = held.id
RETURNING j.id;

-- name: release_leases
-- A worker that stops before its in-flight attempts finished hands their leases back:
-- the lease expires now, so the message's redelivery (or the reaper) takes the job at once
-- and the history reads requeued_after_restart, running.
-- Its attempt is marked released: the job did not end it (the attempt cap counts only
-- attempts that ended with their worker, see poison_expired_leases). Given as (id,
-- lease_version) pairs like heartbeat: a lease taken over since is not this worker's to hand.
WITH mine AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(versions)s::bigint[]) AS m(id, lease_version)
), released AS (
    UPDATE jobs j SET lease_expires_at = now(), updated_at = now()
    FROM mine m
    WHERE j.id = m.id AND j.lease_version = m.lease_version
      AND j.lease_owner = %(worker)s AND j.status = 'running'
    RETURNING j.id, j.step, j.attempt, j.created_at
), attempt_rows AS (
    UPDATE job_attempts a SET finished_at = now(), outcome = 'released'
    FROM released r
    WHERE a.job_id = r.id AND a.step = r.step AND a.attempt = r.attempt
      AND a.started_at >= r.created_at AND a.finished_at IS NULL
)
SELECT id FROM released;

-- name: poison_expired_leases
-- The attempt cap. A job whose lease expired on an attempt that had used up its budget
-- (attempt >= max_attempts) and that ended with its worker (no outcome was written: killed,
-- out of memory; an attempt its worker handed back on shutdown is marked released and does
-- not count) killed its worker every time: it goes to dead_letter with the code poison
-- instead of being requeued to kill another one. The caller writes its job.result and
-- job.dead_lettered in the same transaction, then reaps the rest (reap_expired_leases).
WITH poisoned AS (
    SELECT j.id FROM jobs j
    WHERE j.status = 'running' AND j.lease_expires_at < now()
      AND j.attempt >= j.max_attempts
      AND NOT EXISTS (
          SELECT 1 FROM job_attempts a
          WHERE a.job_id = j.id AND a.step = j.step AND a.attempt = j.attempt
            AND a.started_at >= j.created_at AND a.outcome = 'released')
    ORDER BY j.lease_expires_at
    LIMIT %(limit)s
    FOR UPDATE OF j SKIP LOCKED
), dead AS (
    UPDATE jobs j SET status = 'dead_letter', lease_owner = NULL, lease_expires_at = NULL,
                      error = %(error)s::jsonb,
                      errors = calmq_append_error(j.errors,
                          %(error)s::jsonb || jsonb_build_object('attempt', j.attempt),
                          %(keep_errors)s),
                      updated_at = now()
    FROM poisoned p WHERE j.id = p.id
    RETURNING {{job_row}}, 'running'::text AS old_status, j.errors, j.input_tokens,
              j.output_tokens, j.cost_usd
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'dead_lettered', attempt, %(error)s::jsonb FROM dead
), abandoned AS (
    UPDATE job_attempts a SET finished_at = now(), outcome = 'abandoned',
                              error_code = %(error)s::jsonb ->> 'code',
                              error_class = %(error)s::jsonb ->> 'class',
                              error_message = %(error)s::jsonb ->> 'message'
    FROM dead d
    WHERE a.job_id = d.id AND a.step = d.step AND a.attempt = d.attempt
      AND a.started_at >= d.created_at AND a.finished_at IS NULL
)
SELECT * FROM dead;

-- name: reap_expired_leases
-- Jobs whose worker stopped heartbeating (killed, partitioned): back to queued, with the
-- history saying so, and a fresh job.requested through the outbox.
WITH expired AS (
    SELECT id FROM jobs
    WHERE status = 'running' AND lease_expires_at < now()
      -- a job at its attempt cap is poison_expired_leases' (a dead letter, not a requeue)
      AND NOT (attempt >= max_attempts AND NOT EXISTS (
          SELECT 1 FROM job_attempts a
          WHERE a.job_id = jobs.id AND a.step = jobs.step AND a.attempt = jobs.attempt
            AND a.started_at >= jobs.created_at AND a.outcome = 'released'))
    ORDER BY lease_expires_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
), requeued AS (
    UPDATE jobs j SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL,
                      updated_at = now()
    FROM expired e WHERE j.id = e.id
    -- read as calmq.data.jobs.Job, like claim_jobs' rows
    RETURNING {{job_row}}, 'running'::text AS old_status
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'requeued_after_restart', attempt, '{"reason": "lease_expired"}'::jsonb
    FROM requeued
), abandoned AS (
    UPDATE job_attempts a SET finished_at = now(), outcome = 'abandoned'
    FROM requeued r
    WHERE a.job_id = r.id AND a.step = r.step AND a.attempt = r.attempt
      AND a.started_at >= r.created_at AND a.finished_at IS NULL
)
SELECT * FROM requeued;

-- name: sweep_lock
-- One sweeper pass at a time in the whole fleet: every worker and `calmq reaper` schedules
-- one, the first to take this lock (released with its transaction) does the pass, the others
-- find it taken and skip theirs.
SELECT pg_try_advisory_xact_lock(hashtextextended('calmq.sweeper', 0)) AS held;

-- name: sweep_stranded_jobs
-- The safety net for waiting jobs that no message carries any more (a message acked after a
-- decode error, a deferral that gave up, a rejected publish): a job queued, or retrying past
-- the time its retry was due, for longer than the grace gets a fresh job.requested (the
-- caller writes it in the same transaction) and the event requeued_by_sweeper. Its status
-- stays; updated_at moves on, so the next pass leaves it alone for another grace. A retry's
-- due time is its retry_scheduled event's time plus the delay it chose; without one, the
-- longest retry tier after updated_at. The jobs_waiting index holds exactly these statuses.
WITH stranded AS (
    SELECT j.id, j.status AS old_status FROM jobs j
    WHERE j.status IN ('queued', 'retrying')
      -- waiting past a spend cap on purpose: release_jobs (spending.sql) re-publishes it
      AND j.waiting_reason IS NULL
      -- implied by the due time below (both are at least updated_at); here for the index
      AND j.updated_at < now() - make_interval(secs => %(grace_seconds)s)
      AND CASE WHEN j.status = 'queued' THEN j.updated_at
               ELSE GREATEST(j.updated_at, COALESCE(
                   (SELECT e.at + make_interval(secs => (e.detail ->> 'delay_seconds')::float8)
                    FROM job_events e
                    WHERE e.job_id = j.id AND e.at >= j.created_at AND e.type = 'retry_scheduled'
                    ORDER BY e.id DESC LIMIT 1),
                   j.updated_at + make_interval(secs => %(longest_tier_seconds)s)))
          END < now() - make_interval(secs => %(grace_seconds)s)
    ORDER BY j.updated_at
    LIMIT %(limit)s
    FOR UPDATE OF j SKIP LOCKED
), swept AS (
    UPDATE jobs j SET updated_at = now()
    FROM stranded s WHERE j.id = s.id
    -- read as calmq.data.jobs.Job, like claim_jobs' rows
    RETURNING {{job_row}}, s.old_status
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'requeued_by_sweeper', attempt,
           jsonb_build_object('reason', 'no_message', 'status', old_status)
    FROM swept
)
SELECT * FROM swept;

-- name: cancel_job
WITH cancelled AS (
    -- waiting_until too: set, it means "re-publish then" (timed_wait_release_jobs)
    UPDATE jobs SET status = 'cancelled', lease_owner = NULL, lease_expires_at = NULL,
                    waiting_until = NULL, updated_at = now()
    WHERE id = %(id)s AND tenant_id = %(tenant_id)s
      AND status NOT IN ('completed', 'dead_letter', 'cancelled')
    RETURNING id, tenant_id, workflow, step, attempt, trace_parent
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    -- who cancelled (the calling key's audit identity), when the caller says
    SELECT id, 'cancelled', attempt,
           CASE WHEN %(by)s::text IS NULL THEN '{}'::jsonb
                ELSE jsonb_build_object('by', %(by)s::text) END
    FROM cancelled
)
SELECT * FROM cancelled;
