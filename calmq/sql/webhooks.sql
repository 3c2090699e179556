-- Webhook deliveries (calmq/data/webhooks.py); the rows are written by the job_events
-- trigger (migrations 0004 and 0009).

-- name: webhook_claim
-- Due deliveries for this dispatcher; SKIP LOCKED lets several API processes share them,
-- and pushing next_at forward is the lease: a dispatcher killed mid-send leaves the row
-- to be tried again after lease_seconds.
-- Per-tenant slots: a tenant already holding `held` deliveries in flight in this process
-- gets at most per_tenant - held more, and one holding them all (`full`) is skipped
-- before the scan, so a dead endpoint's backlog neither fills a claim nor hides the other
-- tenants' rows behind it. The scan reads the `scan` oldest due rows of the others.
WITH held AS (
    SELECT h.tenant_id, h.n FROM unnest(%(tenants)s::uuid[], %(held)s::int[]) AS h(tenant_id, n)
), ranked AS (
    SELECT w.id, w.next_at,
           row_number() OVER (PARTITION BY w.tenant_id ORDER BY w.next_at, w.id)
               + coalesce(held.n, 0) AS place
    FROM (SELECT id, tenant_id, next_at FROM webhook_deliveries
          WHERE status = 'pending' AND next_at <= now()
            AND tenant_id <> ALL (%(full)s::uuid[])
          ORDER BY next_at
          LIMIT %(scan)s) w
    LEFT JOIN held ON held.tenant_id = w.tenant_id
), due AS (
    SELECT d.id FROM webhook_deliveries d JOIN ranked r ON r.id = d.id
    WHERE r.place <= %(per_tenant)s AND d.status = 'pending' AND d.next_at <= now()
    ORDER BY r.next_at
    LIMIT %(limit)s
    FOR UPDATE OF d SKIP LOCKED
)
UPDATE webhook_deliveries d
SET next_at = now() + make_interval(secs => %(lease_seconds)s), attempts = d.attempts + 1
FROM due, tenants t
WHERE d.id = due.id AND t.id = d.tenant_id
RETURNING d.id, d.job_id, d.tenant_id, d.url, d.event_type, d.attempts, t.webhook_secret,
          d.created_at,
          -- the secret a rotation replaced, while its grace lasts (migration 0010)
          CASE WHEN t.webhook_secret_previous_until > now() THEN t.webhook_secret_previous END
              AS webhook_secret_previous;

-- name: webhook_attempt
INSERT INTO webhook_attempts (delivery_id, attempt, status_code, error, duration_ms)
VALUES (%(id)s, %(attempt)s, %(status_code)s, %(error)s, %(duration_ms)s);

-- name: webhook_done
UPDATE webhook_deliveries
SET status = %(status)s,
    next_at = CASE WHEN %(status)s = 'pending'
                   THEN now() + make_interval(secs => %(delay_seconds)s) ELSE next_at END,
    finished_at = CASE WHEN %(status)s = 'pending' THEN NULL ELSE now() END
WHERE id = %(id)s;

-- name: webhook_next_due
-- Of the tenants with a free slot in this process (`full`: those without).
SELECT EXTRACT(EPOCH FROM (min(next_at) - now()))::float8 AS seconds
FROM webhook_deliveries WHERE status = 'pending' AND tenant_id <> ALL (%(full)s::uuid[]);
