-- Named queries of the token budget and the usage ledger (calmq/calls/budget.py).

-- name: budget_configure
-- Every worker writes the limits it was started with; the fleet shares the last ones written.
-- The levels are kept, so a restart does not hand out a fresh burst.
INSERT INTO budget_buckets (provider, model, tokens_per_minute, requests_per_minute,
                            token_rate, request_rate, token_cap, request_cap, interactive_share)
VALUES (%(provider)s, %(model)s, %(tokens_per_minute)s, %(requests_per_minute)s,
        %(token_rate)s, %(request_rate)s, %(token_cap)s, %(request_cap)s,
        %(interactive_share)s)
ON CONFLICT (provider, model) DO UPDATE SET
    tokens_per_minute = excluded.tokens_per_minute,
    requests_per_minute = excluded.requests_per_minute,
    token_rate = excluded.token_rate, request_rate = excluded.request_rate,
    token_cap = excluded.token_cap, request_cap = excluded.request_cap,
    interactive_share = excluded.interactive_share,
    updated_at = now();

-- name: budget_take
SELECT granted_tokens, granted_requests, wait_seconds, known
FROM calmq_budget_take(%(provider)s, %(model)s, %(priority)s, %(need_tokens)s,
                       %(want_tokens)s, %(want_requests)s);

-- name: budget_give_back
SELECT calmq_budget_give_back(%(provider)s, %(model)s, %(priority)s, %(tokens)s,
                              %(requests)s);

-- name: budget_pause
-- A 429 means the provider's own window is full: stop the whole fleet until Retry-After and
-- drop what the buckets hold (it was computed for a window the provider disagrees with).
UPDATE budget_buckets SET
    paused_until = greatest(paused_until,
                            clock_timestamp() + make_interval(secs => %(seconds)s)),
    bulk_tokens = least(bulk_tokens, 0), bulk_requests = least(bulk_requests, 0),
    interactive_tokens = least(interactive_tokens, 0),
    interactive_requests = least(interactive_requests, 0),
    updated_at = now()
WHERE provider = %(provider)s AND model = %(model)s;

-- name: budget_record_usage
-- Add model calls' tokens and cost to the job's totals and to its current attempt (the
-- job row names the step and attempt while this worker holds its lease).
WITH job AS (
    UPDATE jobs SET input_tokens = input_tokens + %(input_tokens)s,
                    output_tokens = output_tokens + %(output_tokens)s,
                    cost_usd = cost_usd + %(cost_usd)s,
                    cached_input_tokens = cached_input_tokens + %(cached_input_tokens)s,
                    cache_write_tokens = cache_write_tokens + %(cache_write_tokens)s,
                    cache_saved_usd = cache_saved_usd + %(cache_saved_usd)s
    WHERE id = %(job_id)s
    RETURNING id, step, attempt, created_at
)
UPDATE job_attempts a SET model_calls = a.model_calls + %(model_calls)s,
                          input_tokens = a.input_tokens + %(input_tokens)s,
                          output_tokens = a.output_tokens + %(output_tokens)s,
                          cost_usd = a.cost_usd + %(cost_usd)s,
                          cached_input_tokens = a.cached_input_tokens + %(cached_input_tokens)s,
                          cache_write_tokens = a.cache_write_tokens + %(cache_write_tokens)s,
                          cache_saved_usd = a.cache_saved_usd + %(cache_saved_usd)s
FROM job WHERE a.job_id = job.id AND a.step = job.step AND a.attempt = job.attempt
  AND a.started_at >= job.created_at;  -- its partitions: from the job's creation on

-- name: budget_bucket
-- paused_until is -infinity when never paused, which Python datetimes cannot hold: NULL.
SELECT provider, model, tokens_per_minute, requests_per_minute, token_rate, request_rate,
       token_cap, request_cap, interactive_share, bulk_tokens, bulk_requests,
       interactive_tokens, interactive_requests, refilled_at,
       CASE WHEN isfinite(paused_until) THEN paused_until END AS paused_until
FROM budget_buckets WHERE provider = %(provider)s AND model = %(model)s;

-- name: tenant_tokens_take
-- A tenant's token quota (migrations 0012, 0037): take one call's estimate, at most
-- %(debt)s tokens into debt, or say how long to wait.
SELECT granted, wait_seconds
FROM calmq_tenant_tokens_take(%(tenant_id)s, %(need)s::float8, %(rate)s::float8,
                              %(cap)s::float8, %(debt)s::float8);

-- name: tenant_tokens_give_back
-- What a call did not spend (a failed call: all of it) goes back, never above capacity.
UPDATE tenant_token_buckets SET tokens = least(%(cap)s, tokens + %(tokens)s)
WHERE tenant_id = %(tenant_id)s;

-- name: tenant_token_quotas
-- Tenants with a quota of their own (NULL: the default share).
SELECT id, tokens_per_minute FROM tenants WHERE tokens_per_minute IS NOT NULL;

-- name: tenant_token_level
SELECT tokens, refilled_at FROM tenant_token_buckets WHERE tenant_id = %(tenant_id)s;

-- name: tenant_tokens_active
-- Tenants that made calls in the last minute: the fair share divides the fleet's quota
-- among them. One row per tenant ever seen: a scan of a small table.
SELECT count(*) AS active FROM tenant_token_buckets
WHERE refilled_at > clock_timestamp() - interval '1 minute';
