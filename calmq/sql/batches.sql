-- Provider batches of the batch lane (calmq/data/batches.py, calmq/processors/batcher.py).
-- A batch's jobs are held under the lease owner 'batch:<key>' from the moment they are
-- packed until their result is settled, so no worker, reaper or second batcher takes them,
-- and a late or duplicate result is a no-op (finish_attempts' lease guard).

-- name: batch_insert
INSERT INTO provider_batches (key, provider, model, endpoint, pool, request_count, input_bytes,
                              enqueued_tokens, lease_owner, lease_expires_at)
VALUES (%(key)s, %(provider)s, %(model)s, %(endpoint)s, %(pool)s, %(request_count)s,
        %(input_bytes)s, %(enqueued_tokens)s, %(worker)s,
        now() + make_interval(secs => %(lease_seconds)s));

-- name: batch_take_jobs
-- The packed jobs the batcher still holds move to the batch's lease (held for the
-- provider's window plus the margin); a job cancelled or taken meanwhile is left out. Given
-- as (id, lease_version) pairs like heartbeat: the attempt's fencing token stays the batch's
-- (its result is settled under it). Locked in id order, like claim, heartbeat and finish.
WITH mine AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(versions)s::bigint[]) AS m(id, lease_version)
), held AS (
    SELECT j.id FROM jobs j JOIN mine m ON m.id = j.id AND m.lease_version = j.lease_version
    WHERE j.lease_owner = %(worker)s AND j.status = 'running'
    ORDER BY j.id
    FOR UPDATE OF j
)
UPDATE jobs j SET lease_owner = %(owner)s,
                  lease_expires_at = now() + make_interval(secs => %(hold_seconds)s),
                  updated_at = now()
FROM held WHERE j.id = held.id
RETURNING j.id;

-- name: batch_insert_jobs
INSERT INTO batch_jobs (batch_key, job_id, attempt, custom_id, request)
SELECT %(key)s, r.job_id, r.attempt, r.custom_id, r.request
FROM jsonb_to_recordset(%(rows)s::jsonb)
     AS r(job_id uuid, attempt integer, custom_id text, request jsonb)
WHERE r.job_id = ANY(%(ids)s);

-- name: batch_set_count
UPDATE provider_batches SET request_count = %(count)s,
                            state = CASE WHEN %(count)s = 0 THEN 'abandoned' ELSE state END
WHERE key = %(key)s;

-- name: batch_submitted
-- The provider has the batch: its id is recorded, every job of it gets a ``batched``
-- history event carrying the id, and the batch waits for its first poll.
WITH b AS (
    UPDATE provider_batches SET provider_id = %(provider_id)s, state = 'submitted',
                                submitted_at = now(), provider_status = %(status)s,
                                lease_owner = NULL, lease_expires_at = NULL,
                                next_poll_at = now() + make_interval(secs => %(poll_seconds)s)
    WHERE key = %(key)s AND state = 'creating'
    RETURNING key, provider, provider_id
)
INSERT INTO job_events (job_id, type, attempt, detail)
SELECT bj.job_id, 'batched', bj.attempt,
       jsonb_build_object('batch_id', b.provider_id, 'batch_key', b.key::text,
                          'provider', b.provider, 'custom_id', bj.custom_id)
FROM b JOIN batch_jobs bj ON bj.batch_key = b.key AND bj.state = 'pending'
ORDER BY bj.job_id;

-- name: batch_claim_due
-- A poller takes the batches due for a look whose lease is free (one poller per batch): the
-- open ones, and the ended ones whose files the provider still holds (migration 0036).
WITH due AS (
    SELECT key FROM provider_batches
    WHERE (state IN ('creating', 'submitted')
           OR (files_deleted_at IS NULL AND provider_id IS NOT NULL
               AND state IN ('collected', 'abandoned')))
      AND next_poll_at <= now()
      AND (lease_expires_at IS NULL OR lease_expires_at < now())
      AND (%(pool)s::text IS NULL OR pool = %(pool)s)
    ORDER BY next_poll_at
    LIMIT %(limit)s
    FOR UPDATE SKIP LOCKED
)
UPDATE provider_batches b SET lease_owner = %(worker)s,
                              lease_expires_at = now() + make_interval(secs => %(lease_seconds)s)
FROM due WHERE b.key = due.key
RETURNING b.key, b.provider, b.model, b.endpoint, b.pool, b.provider_id, b.state,
          b.request_count, b.created_at, b.cancel_requested;

-- name: batch_heartbeat
UPDATE provider_batches SET lease_expires_at = now() + make_interval(secs => %(lease_seconds)s)
WHERE key = %(key)s AND lease_owner = %(worker)s
RETURNING key;

-- name: batch_release
-- A look that found the batch still running: the next one after the poll interval.
UPDATE provider_batches SET lease_owner = NULL, lease_expires_at = NULL,
                            provider_status = %(status)s, counts = %(counts)s,
                            next_poll_at = now() + make_interval(secs => %(poll_seconds)s)
WHERE key = %(key)s AND lease_owner = %(worker)s;

-- name: batch_requests
-- What a batch sends, to create it again at the provider when it never got there.
SELECT custom_id, request FROM batch_jobs
WHERE batch_key = %(key)s AND state = 'pending' ORDER BY custom_id;

-- name: batch_known_ids
SELECT provider_id FROM provider_batches WHERE provider = %(provider)s AND provider_id IS NOT NULL;

-- name: batch_pending_jobs
-- The jobs a batch's results settle: still pending in the batch and still held by it at the
-- attempt the request was for (a job cancelled meanwhile is not, and its result is ignored).
-- With custom_ids NULL: every such job (the ones a finished batch did not answer).
SELECT {{job_row}}, j.status AS old_status, bj.custom_id
FROM batch_jobs bj JOIN jobs j ON j.id = bj.job_id
WHERE bj.batch_key = %(key)s AND bj.state = 'pending'
  AND (%(custom_ids)s::text[] IS NULL OR bj.custom_id = ANY(%(custom_ids)s::text[]))
  AND j.status = 'running' AND j.lease_owner = %(owner)s AND j.attempt = bj.attempt
ORDER BY j.id
LIMIT %(limit)s;

-- name: batch_settle
UPDATE batch_jobs bj SET state = r.state, input_tokens = r.input_tokens,
                         output_tokens = r.output_tokens, cost_usd = r.cost_usd,
                         online_cost_usd = r.online_cost_usd, settled_at = now()
FROM jsonb_to_recordset(%(rows)s::jsonb)
     AS r(custom_id text, state text, input_tokens bigint, output_tokens bigint,
          cost_usd float8, online_cost_usd float8)
WHERE bj.batch_key = %(key)s AND bj.custom_id = r.custom_id AND bj.state = 'pending';

-- name: batch_fall_back_online
-- Jobs whose deadline a new batch would miss continue online (their retry's topic is the
-- online one, and a requeue after a lost lease goes there too).
UPDATE jobs SET lane = 'online' WHERE id = ANY(%(ids)s) AND lane = 'batch';

-- name: batch_collected
-- Every job of the batch is settled; a pending row left is a job that was no longer held.
WITH orphans AS (
    UPDATE batch_jobs SET state = 'cancelled', settled_at = now()
    WHERE batch_key = %(key)s AND state = 'pending'
)
UPDATE provider_batches SET state = 'collected', collected_at = now(),
                            ended_at = COALESCE(ended_at, now()),
                            provider_status = %(status)s, counts = %(counts)s,
                            lease_owner = NULL, lease_expires_at = NULL
WHERE key = %(key)s;

-- name: batch_enqueued_tokens
-- What the provider's batch queue holds for a model (its enqueued-token limit).
SELECT COALESCE(sum(enqueued_tokens), 0)::bigint AS tokens FROM provider_batches
WHERE provider = %(provider)s AND model = %(model)s AND state IN ('creating', 'submitted');

-- name: batch_list
-- Batches newest first; for a tenant (tenant_id set) only those holding its jobs, and every
-- count and cost of a batch is the tenant's own share of it (a batch packs many tenants'
-- requests: its request_count, provider counts and cost are nobody else's business), with
-- ``others``, how many of its requests are other tenants' (0 unscoped).
SELECT b.key, b.provider, b.model, b.pool, b.provider_id, b.state, b.provider_status,
       CASE WHEN %(tenant_id)s::uuid IS NULL THEN b.request_count ELSE mine.n END
           AS request_count,
       b.created_at, b.submitted_at, b.ended_at, b.collected_at,
       CASE WHEN %(tenant_id)s::uuid IS NULL THEN b.counts ELSE mine.counts END AS counts,
       b.cancel_requested, mine.cost_usd, mine.online_cost_usd, mine.others
FROM provider_batches b
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE x.mine)::int AS n,
           COALESCE(sum(x.cost_usd) FILTER (WHERE x.mine), 0)::float8 AS cost_usd,
           COALESCE(sum(x.online_cost_usd) FILTER (WHERE x.mine), 0)::float8 AS online_cost_usd,
           COALESCE((SELECT jsonb_object_agg(s.state, s.c) FROM (
                SELECT y.state, count(*) AS c
                FROM batch_jobs y JOIN jobs yj ON yj.id = y.job_id
                WHERE y.batch_key = b.key
                  AND (%(tenant_id)s::uuid IS NULL OR yj.tenant_id = %(tenant_id)s::uuid)
                GROUP BY y.state) s), '{}'::jsonb) AS counts,
           count(*) FILTER (WHERE NOT x.mine)::int AS others
    FROM (SELECT bj.cost_usd, bj.online_cost_usd,
                 (%(tenant_id)s::uuid IS NULL OR j.tenant_id = %(tenant_id)s::uuid) AS mine
          FROM batch_jobs bj JOIN jobs j ON j.id = bj.job_id
          WHERE bj.batch_key = b.key) x
) mine
WHERE (%(state)s::text IS NULL OR b.state = %(state)s)
  AND (%(tenant_id)s::uuid IS NULL OR mine.n > 0)
ORDER BY b.created_at DESC
LIMIT %(limit)s;

-- name: batch_find
-- One batch by calmq's key or the provider's id, scoped as batch_list.
SELECT b.key, b.provider, b.model, b.pool, b.provider_id, b.state, b.provider_status,
       CASE WHEN %(tenant_id)s::uuid IS NULL THEN b.request_count ELSE mine.n END
           AS request_count,
       b.created_at, b.submitted_at, b.ended_at, b.collected_at,
       CASE WHEN %(tenant_id)s::uuid IS NULL THEN b.counts ELSE mine.counts END AS counts,
       b.cancel_requested, mine.cost_usd, mine.online_cost_usd, mine.others
FROM provider_batches b
CROSS JOIN LATERAL (
    SELECT count(*) FILTER (WHERE x.mine)::int AS n,
           COALESCE(sum(x.cost_usd) FILTER (WHERE x.mine), 0)::float8 AS cost_usd,
           COALESCE(sum(x.online_cost_usd) FILTER (WHERE x.mine), 0)::float8 AS online_cost_usd,
           COALESCE((SELECT jsonb_object_agg(s.state, s.c) FROM (
                SELECT y.state, count(*) AS c
                FROM batch_jobs y JOIN jobs yj ON yj.id = y.job_id
                WHERE y.batch_key = b.key
                  AND (%(tenant_id)s::uuid IS NULL OR yj.tenant_id = %(tenant_id)s::uuid)
                GROUP BY y.state) s), '{}'::jsonb) AS counts,
           count(*) FILTER (WHERE NOT x.mine)::int AS others
    FROM (SELECT bj.cost_usd, bj.online_cost_usd,
                 (%(tenant_id)s::uuid IS NULL OR j.tenant_id = %(tenant_id)s::uuid) AS mine
          FROM batch_jobs bj JOIN jobs j ON j.id = bj.job_id
          WHERE bj.batch_key = b.key) x
) mine
WHERE (b.key::text = %(ref)s OR b.provider_id = %(ref)s)
  AND (%(tenant_id)s::uuid IS NULL OR mine.n > 0);

-- name: batch_members
SELECT bj.job_id, bj.attempt, bj.custom_id, bj.state, bj.input_tokens, bj.output_tokens,
       bj.cost_usd, bj.online_cost_usd, bj.settled_at, j.status
FROM batch_jobs bj JOIN jobs j ON j.id = bj.job_id
WHERE bj.batch_key = %(key)s AND (%(tenant_id)s::uuid IS NULL OR j.tenant_id = %(tenant_id)s)
ORDER BY bj.job_id
LIMIT %(limit)s;

-- name: batch_request_cancel
UPDATE provider_batches SET cancel_requested = true, next_poll_at = now()
WHERE key = %(key)s AND state IN ('creating', 'submitted')
RETURNING key;

-- name: batch_stats
-- The batch lane's gauges: open batches and the oldest one's age; batched jobs by state.
SELECT (SELECT count(*) FROM provider_batches WHERE state IN ('creating', 'submitted'))
           AS open_batches,
       (SELECT COALESCE(extract(epoch FROM now() - min(created_at)), 0)::float8
        FROM provider_batches WHERE state IN ('creating', 'submitted')) AS oldest_seconds,
       (SELECT COALESCE(jsonb_object_agg(state, n), '{}'::jsonb) FROM (
            SELECT bj.state, count(*) AS n FROM batch_jobs bj
            JOIN provider_batches b ON b.key = bj.batch_key
            WHERE b.state IN ('creating', 'submitted') OR bj.settled_at > now() - interval '1 hour'
            GROUP BY bj.state) s) AS jobs_by_state;

-- name: batch_files_deleted
-- The provider holds nothing of the batch any more (calmq deleted it, or found it gone).
UPDATE provider_batches SET files_deleted_at = now(), lease_owner = NULL,
                            lease_expires_at = NULL
WHERE key = %(key)s;

-- name: batch_hand_back
-- Jobs of a batch given back with no attempt counted (their attempt row removed): a
-- provider whose key was refused (waiting_reason provider_blocked, released when the block
-- lifts), or a batch the provider failed for another request's line (re-published by the
-- caller in this transaction). ids NULL: every job the batch still holds. Only jobs still
-- held by the batch at the attempt it carried.
WITH held AS (
    SELECT j.id, j.step, j.attempt FROM jobs j
    JOIN batch_jobs bj ON bj.job_id = j.id AND bj.batch_key = %(key)s
                      AND bj.state = 'pending' AND bj.attempt = j.attempt
    WHERE (%(ids)s::uuid[] IS NULL OR j.id = ANY(%(ids)s::uuid[]))
      AND j.lease_owner = %(owner)s AND j.status = 'running'
    ORDER BY j.id
    FOR UPDATE OF j
), back AS (
    UPDATE jobs j SET status = 'queued', attempt = j.attempt - 1,
                      lease_owner = NULL, lease_expires_at = NULL,
                      waiting_reason = %(waiting_reason)s, updated_at = now()
    FROM held WHERE j.id = held.id
    RETURNING {{job_row}}, 'running'::text AS old_status
), uncounted AS (
    DELETE FROM job_attempts a USING held
    WHERE a.job_id = held.id AND a.step = held.step AND a.attempt = held.attempt
), retried AS (
    UPDATE batch_jobs bj SET state = 'retried', settled_at = now()
    FROM held WHERE bj.batch_key = %(key)s AND bj.job_id = held.id
                AND bj.attempt = held.attempt AND bj.state = 'pending'
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'waiting', attempt, %(detail)s::jsonb FROM back
)
SELECT * FROM back;

-- name: batch_abandon
-- A batch the provider never created (its create was refused): nothing to collect.
UPDATE provider_batches SET state = 'abandoned', lease_owner = NULL, lease_expires_at = NULL,
                            ended_at = now()
WHERE key = %(key)s AND state = 'creating';

-- name: batch_later
-- A look at the batch was refused by the provider: the next one after a while.
UPDATE provider_batches SET lease_owner = NULL, lease_expires_at = NULL,
                            next_poll_at = now() + make_interval(secs => %(seconds)s)
WHERE key = %(key)s AND lease_owner = %(worker)s;
