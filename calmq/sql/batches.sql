-- Provider batches of the batch lane (calmq/data/batches.py, calmq/processors/batcher.py).
-- A batch's jobs are held under the lease owner 'batch:<key>' from the moment they are
-- packed until their result is settled, so no worker, reaper or second batcher takes them,
-- and a late or duplicate result is a no-op (finish_attempts' lease guard).
--
-- Each tenant's share of a batch is a row of batch_tenants (migration 0049): its requests,
-- their counts by state and their cost as they settle, and what they reserve against its
-- spend caps until then. Every statement that moves a request out of ``pending`` updates its
-- share in the same statement; one that ends a batch drops what the batch still reserves.

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

-- name: batch_lock_packed
-- Every job of a pack being recorded, locked in id order (claim, heartbeat and finish lock
-- in that order) before batch_take_jobs and batch_hold_packed each take their part of them.
SELECT id FROM jobs WHERE id = ANY(%(ids)s::uuid[]) ORDER BY id FOR UPDATE;

-- name: batch_hold_packed
-- Packed jobs a spend cap refuses (calmq.spending: their tenant, or the fleet, reached it
-- with what is spent and reserved) are not sent: back to queued at the attempt before (their
-- attempt row removed: none is counted), waiting with the cap's reason as a job the spend
-- gate held, until the spend release pass re-publishes them. Given as (id, lease_version,
-- reason); only jobs the packing attempt still holds.
WITH mine AS (
    SELECT * FROM unnest(%(ids)s::uuid[], %(versions)s::bigint[], %(reasons)s::text[])
        AS m(id, lease_version, reason)
), held AS (
    SELECT j.id, j.step, j.attempt, j.created_at, m.reason FROM jobs j
    JOIN mine m ON m.id = j.id AND m.lease_version = j.lease_version
    WHERE j.lease_owner = %(worker)s AND j.status = 'running'
    ORDER BY j.id
    FOR UPDATE OF j
), back AS (
    UPDATE jobs j SET status = 'queued', attempt = j.attempt - 1,
                      lease_owner = NULL, lease_expires_at = NULL,
                      waiting_reason = held.reason, updated_at = now()
    FROM held WHERE j.id = held.id
    RETURNING j.id, held.step, held.attempt, held.created_at, held.reason
), uncounted AS (
    DELETE FROM job_attempts a USING back
    WHERE a.job_id = back.id AND a.step = back.step AND a.attempt = back.attempt
      AND a.started_at >= back.created_at
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'waiting', attempt - 1, jsonb_build_object('reason', reason) FROM back
)
SELECT id FROM back;

-- name: batch_insert_jobs
INSERT INTO batch_jobs (batch_key, job_id, attempt, custom_id, request, reserved_usd)
SELECT %(key)s, r.job_id, r.attempt, r.custom_id, r.request, r.reserved_usd
FROM jsonb_to_recordset(%(rows)s::jsonb)
     AS r(job_id uuid, attempt integer, custom_id text, request jsonb, reserved_usd numeric)
WHERE r.job_id = ANY(%(ids)s);

-- name: batch_insert_tenants
-- Each tenant's share of the batch being recorded (the requests that moved into it), with
-- what they reserve against its spend caps from now on.
INSERT INTO batch_tenants (batch_key, tenant_id, created_at, requests, reserved_day,
                           reserved_usd)
SELECT bj.batch_key, j.tenant_id, b.created_at, count(*)::int,
       (now() AT TIME ZONE 'UTC')::date, sum(bj.reserved_usd)
FROM batch_jobs bj
JOIN jobs j ON j.id = bj.job_id
JOIN provider_batches b ON b.key = bj.batch_key
WHERE bj.batch_key = %(key)s
GROUP BY bj.batch_key, j.tenant_id, b.created_at;

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
-- Requests settled (or retried) with their tokens and both costs; their tenants' shares
-- count them, and drop what they reserved: the attempt's real cost was written with its
-- outcome, just before (until this commits, both count: a cap errs on the safe side).
WITH done AS (
    UPDATE batch_jobs bj SET state = r.state, input_tokens = r.input_tokens,
                             output_tokens = r.output_tokens, cost_usd = r.cost_usd,
                             online_cost_usd = r.online_cost_usd, settled_at = now()
    FROM jsonb_to_recordset(%(rows)s::jsonb)
         AS r(custom_id text, state text, input_tokens bigint, output_tokens bigint,
              cost_usd float8, online_cost_usd float8)
    WHERE bj.batch_key = %(key)s AND bj.custom_id = r.custom_id AND bj.state = 'pending'
    RETURNING bj.job_id, bj.state, bj.cost_usd, bj.online_cost_usd, bj.reserved_usd
), shares AS (
    SELECT j.tenant_id, count(*) FILTER (WHERE d.state = 'settled') AS settled,
           count(*) FILTER (WHERE d.state = 'retried') AS retried,
           sum(d.cost_usd) AS cost_usd, sum(d.online_cost_usd) AS online_cost_usd,
           sum(d.reserved_usd) AS reserved_usd
    FROM done d JOIN jobs j ON j.id = d.job_id
    GROUP BY j.tenant_id
)
UPDATE batch_tenants t SET settled = t.settled + s.settled, retried = t.retried + s.retried,
                           cost_usd = t.cost_usd + s.cost_usd,
                           online_cost_usd = t.online_cost_usd + s.online_cost_usd,
                           reserved_usd = greatest(t.reserved_usd - s.reserved_usd, 0)
FROM shares s WHERE t.batch_key = %(key)s AND t.tenant_id = s.tenant_id;

-- name: batch_fall_back_online
-- Jobs whose deadline a new batch would miss continue online (their retry's topic is the
-- online one, and a requeue after a lost lease goes there too).
UPDATE jobs SET lane = 'online' WHERE id = ANY(%(ids)s) AND lane = 'batch';

-- name: batch_collected
-- Every job of the batch is settled; a pending row left is a job that was no longer held.
-- The batch reserves nothing any more.
WITH orphans AS (
    UPDATE batch_jobs SET state = 'cancelled', settled_at = now()
    WHERE batch_key = %(key)s AND state = 'pending'
    RETURNING job_id
), shares AS (
    SELECT j.tenant_id, count(*) AS cancelled
    FROM orphans o JOIN jobs j ON j.id = o.job_id
    GROUP BY j.tenant_id
), released AS (
    UPDATE batch_tenants t
    SET cancelled = t.cancelled + coalesce((SELECT s.cancelled FROM shares s
                                            WHERE s.tenant_id = t.tenant_id), 0),
        reserved_usd = 0
    WHERE t.batch_key = %(key)s
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
-- Every batch, newest first (the operator's list: calmq batches list).
SELECT b.key, b.provider, b.model, b.pool, b.provider_id, b.state, b.provider_status,
       b.request_count, b.created_at, b.submitted_at, b.ended_at, b.collected_at, b.counts,
       b.cancel_requested, coalesce(s.cost_usd, 0)::float8 AS cost_usd,
       coalesce(s.online_cost_usd, 0)::float8 AS online_cost_usd, 0 AS others
FROM provider_batches b
LEFT JOIN LATERAL (
    SELECT sum(t.cost_usd) AS cost_usd, sum(t.online_cost_usd) AS online_cost_usd
    FROM batch_tenants t WHERE t.batch_key = b.key
) s ON true
WHERE (%(state)s::text IS NULL OR b.state = %(state)s)
ORDER BY b.created_at DESC
LIMIT %(limit)s;

-- name: batch_list_tenant
-- The batches holding a tenant's jobs, newest first, read from the tenant's own shares
-- (batch_tenants_list), a page at a time: after the cursor (created_at, key) of the last
-- one of the page before. Every count and cost is the tenant's share (a batch packs many
-- tenants' requests: its request_count, provider counts and cost are nobody else's
-- business), with ``others``, how many of its requests are other tenants'.
SELECT b.key, b.provider, b.model, b.pool, b.provider_id, b.state, b.provider_status,
       t.requests AS request_count, b.created_at, b.submitted_at, b.ended_at,
       b.collected_at,
       jsonb_strip_nulls(jsonb_build_object(
           'pending', nullif(t.requests - t.settled - t.retried - t.cancelled, 0),
           'settled', nullif(t.settled, 0), 'retried', nullif(t.retried, 0),
           'cancelled', nullif(t.cancelled, 0))) AS counts,
       b.cancel_requested, t.cost_usd, t.online_cost_usd,
       greatest(b.request_count - t.requests, 0) AS others
FROM batch_tenants t
JOIN provider_batches b ON b.key = t.batch_key
WHERE t.tenant_id = %(tenant_id)s
  AND (%(cursor_at)s::timestamptz IS NULL
       OR (t.created_at, t.batch_key) < (%(cursor_at)s::timestamptz, %(cursor_key)s::uuid))
  AND (%(state)s::text IS NULL OR b.state = %(state)s)
ORDER BY t.created_at DESC, t.batch_key DESC
LIMIT %(limit)s;

-- name: batch_find
-- One batch by calmq's key or the provider's id (the operator's: every request counted).
SELECT b.key, b.provider, b.model, b.pool, b.provider_id, b.state, b.provider_status,
       b.request_count, b.created_at, b.submitted_at, b.ended_at, b.collected_at, b.counts,
       b.cancel_requested, coalesce(s.cost_usd, 0)::float8 AS cost_usd,
       coalesce(s.online_cost_usd, 0)::float8 AS online_cost_usd, 0 AS others
FROM provider_batches b
LEFT JOIN LATERAL (
    SELECT sum(t.cost_usd) AS cost_usd, sum(t.online_cost_usd) AS online_cost_usd
    FROM batch_tenants t WHERE t.batch_key = b.key
) s ON true
WHERE b.key = %(key)s::uuid OR b.provider_id = %(ref)s;

-- name: batch_find_tenant
-- One batch holding the tenant's jobs, by calmq's key or the provider's id, with the
-- tenant's share as batch_list_tenant gives it.
SELECT b.key, b.provider, b.model, b.pool, b.provider_id, b.state, b.provider_status,
       t.requests AS request_count, b.created_at, b.submitted_at, b.ended_at,
       b.collected_at,
       jsonb_strip_nulls(jsonb_build_object(
           'pending', nullif(t.requests - t.settled - t.retried - t.cancelled, 0),
           'settled', nullif(t.settled, 0), 'retried', nullif(t.retried, 0),
           'cancelled', nullif(t.cancelled, 0))) AS counts,
       b.cancel_requested, t.cost_usd, t.online_cost_usd,
       greatest(b.request_count - t.requests, 0) AS others
FROM provider_batches b
JOIN batch_tenants t ON t.batch_key = b.key AND t.tenant_id = %(tenant_id)s
WHERE b.key = %(key)s::uuid OR b.provider_id = %(ref)s;

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
-- The batch lane's gauges: open batches and the oldest one's age; batched jobs by state;
-- what open batches reserve against the spend caps.
SELECT (SELECT count(*) FROM provider_batches WHERE state IN ('creating', 'submitted'))
           AS open_batches,
       (SELECT COALESCE(extract(epoch FROM now() - min(created_at)), 0)::float8
        FROM provider_batches WHERE state IN ('creating', 'submitted')) AS oldest_seconds,
       (SELECT COALESCE(jsonb_object_agg(state, n), '{}'::jsonb) FROM (
            SELECT bj.state, count(*) AS n FROM batch_jobs bj
            JOIN provider_batches b ON b.key = bj.batch_key
            WHERE b.state IN ('creating', 'submitted') OR bj.settled_at > now() - interval '1 hour'
            GROUP BY bj.state) s) AS jobs_by_state,
       (SELECT coalesce(sum(reserved_usd), 0)::float8 FROM batch_tenants
        WHERE reserved_usd > 0) AS reserved_usd;

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
    RETURNING bj.job_id, bj.reserved_usd
), shares AS (
    SELECT j.tenant_id, count(*) AS retried, sum(r.reserved_usd) AS reserved_usd
    FROM retried r JOIN jobs j ON j.id = r.job_id
    GROUP BY j.tenant_id
), released AS (
    UPDATE batch_tenants t SET retried = t.retried + s.retried,
                               reserved_usd = greatest(t.reserved_usd - s.reserved_usd, 0)
    FROM shares s WHERE t.batch_key = %(key)s AND t.tenant_id = s.tenant_id
), event AS (
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'waiting', attempt, %(detail)s::jsonb FROM back
)
SELECT * FROM back;

-- name: batch_abandon
-- A batch the provider never created (its create was refused): nothing to collect, and
-- nothing reserved any more.
WITH released AS (
    UPDATE batch_tenants SET reserved_usd = 0
    WHERE batch_key = %(key)s AND reserved_usd > 0
      AND EXISTS (SELECT 1 FROM provider_batches
                  WHERE key = %(key)s AND state = 'creating')
)
UPDATE provider_batches SET state = 'abandoned', lease_owner = NULL, lease_expires_at = NULL,
                            ended_at = now()
WHERE key = %(key)s AND state = 'creating';

-- name: batch_later
-- A look at the batch was refused by the provider: the next one after a while.
UPDATE provider_batches SET lease_owner = NULL, lease_expires_at = NULL,
                            next_poll_at = now() + make_interval(secs => %(seconds)s)
WHERE key = %(key)s AND lease_owner = %(worker)s;
