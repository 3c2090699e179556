-- Rate limits per concurrency key (calmq/data/rate_keys.py, migration 0047): token buckets
-- of requests and tokens, refilled evenly over the limit's window (per_seconds). A cap of
-- 0 counts nothing of that kind (and a reservation of it is 0).

-- name: key_rate_reserve
-- Refill the key's bucket to now and take the call's request and token estimate if both
-- fit; else take nothing. One statement on one row: two workers' reservations of one key
-- take turns on its lock, and each reads the row as the other left it (ON CONFLICT reads
-- the latest version). Returns what is left and whether the reservation fitted.
INSERT INTO key_rate_buckets AS b (tenant_id, key, scope, requests, tokens, refilled_at,
                                   last_taken)
VALUES (%(tenant_id)s, %(key)s, %(scope)s, %(requests_cap)s - %(requests)s,
        %(tokens_cap)s - %(tokens)s, statement_timestamp(), true)
ON CONFLICT (tenant_id, key, scope) DO UPDATE SET
    requests = calmq_refilled(b.requests, %(requests_cap)s, b.refilled_at,
                              statement_timestamp(), %(per_seconds)s)
               - CASE WHEN calmq_refilled(b.requests, %(requests_cap)s, b.refilled_at,
                                          statement_timestamp(), %(per_seconds)s)
                           >= %(requests)s
                       AND calmq_refilled(b.tokens, %(tokens_cap)s, b.refilled_at,
                                          statement_timestamp(), %(per_seconds)s)
                           >= %(tokens)s
                      THEN %(requests)s ELSE 0 END,
    tokens = calmq_refilled(b.tokens, %(tokens_cap)s, b.refilled_at,
                            statement_timestamp(), %(per_seconds)s)
             - CASE WHEN calmq_refilled(b.requests, %(requests_cap)s, b.refilled_at,
                                        statement_timestamp(), %(per_seconds)s)
                         >= %(requests)s
                     AND calmq_refilled(b.tokens, %(tokens_cap)s, b.refilled_at,
                                        statement_timestamp(), %(per_seconds)s)
                         >= %(tokens)s
                    THEN %(tokens)s ELSE 0 END,
    -- never back in time: a statement that waited for the lock started before the last
    refilled_at = greatest(b.refilled_at, statement_timestamp()),
    last_taken = calmq_refilled(b.requests, %(requests_cap)s, b.refilled_at,
                                statement_timestamp(), %(per_seconds)s) >= %(requests)s
                 AND calmq_refilled(b.tokens, %(tokens_cap)s, b.refilled_at,
                                    statement_timestamp(), %(per_seconds)s) >= %(tokens)s
RETURNING b.requests, b.tokens, b.last_taken;

-- name: key_rate_settle
-- A call's tokens as the provider counted them: the estimate it reserved minus what it
-- used goes back (or, used more, comes off), never past the cap.
UPDATE key_rate_buckets SET tokens = least(%(tokens_cap)s::float8, tokens + %(refund)s)
WHERE tenant_id = %(tenant_id)s AND key = %(key)s AND scope = %(scope)s;

-- name: key_rate_waiting
-- How many of the key's jobs wait for its rate limit now: a job handed back waits behind
-- them, so that a backlog is released a refill at a time, not all at once.
SELECT count(*) AS n FROM jobs
WHERE waiting_until IS NOT NULL AND waiting_reason = 'rate_limit_key'
  AND tenant_id = %(tenant_id)s AND concurrency_key = %(key)s
  AND status IN ('queued', 'retrying');

-- name: key_rate_retire
-- Buckets idle for a day: full again (no window is longer, calmq.workflows.KeyRateLimit), so
-- dropping one changes nothing; a key's next call starts a full one. Keeps the table to the
-- keys in use, not every customer ever seen.
DELETE FROM key_rate_buckets WHERE refilled_at < now() - interval '1 day';
