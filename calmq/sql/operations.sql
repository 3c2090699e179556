-- What the on-call commands read (calmq/data/operations.py): `calmq lag` and `calmq budget`.

-- name: ops_jobs_in_flight
-- Jobs a worker holds (running with a lease) and jobs waiting for one, per pool and
-- priority, i.e. per work topic. Both sets are small and covered by partial indexes
-- (jobs_running, jobs_waiting), so this is no scan of the whole table: one arm per index,
-- as the planner uses a partial index only for a condition that implies its own (one
-- `status IN (all three)` matches neither, and read the whole table).
SELECT pool, priority, sum(in_flight)::bigint AS in_flight, sum(waiting)::bigint AS waiting
FROM (SELECT pool, priority, count(*) AS in_flight, 0::bigint AS waiting
      FROM jobs WHERE status = 'running' GROUP BY pool, priority
      UNION ALL
      SELECT pool, priority, 0::bigint, count(*)
      FROM jobs WHERE status IN ('queued', 'retrying') GROUP BY pool, priority) arms
GROUP BY pool, priority;

-- name: ops_budget_buckets
-- Every provider and model's buckets, with the levels refilled up to now (the stored
-- levels are as of the last touch, which may be minutes old on an idle fleet). Nothing is
-- written: calmq_budget_refill returns the row without storing it.
SELECT b.provider, b.model, b.tokens_per_minute, b.requests_per_minute, b.token_rate,
       b.request_rate, b.token_cap, b.request_cap, b.interactive_share,
       r.bulk_tokens, r.bulk_requests, r.interactive_tokens, r.interactive_requests,
       CASE WHEN b.paused_until > clock_timestamp() THEN b.paused_until END AS paused_until,
       b.updated_at
FROM budget_buckets b, LATERAL calmq_budget_refill(b, clock_timestamp()) r
ORDER BY b.provider, b.model;

-- name: ops_budget_usage
-- Tokens and model calls per tenant and priority of the attempts that are still running or
-- finished within the window: the use the provider's sliding minute still counts. An
-- attempt's tokens are its total, so a long attempt that started before the window counts
-- whole (an upper bound, never an undercount). Attempts that started more than two days
-- before the window are left out: job_attempts is partitioned by start time, and this bound
-- keeps the read to the newest partitions (an attempt runs for minutes; a batch-lane attempt
-- waits for its provider batch at most a day).
SELECT t.name AS tenant, j.priority,
       count(*) AS attempts,
       coalesce(sum(a.model_calls), 0)::bigint AS model_calls,
       coalesce(sum(a.input_tokens), 0)::bigint AS input_tokens,
       coalesce(sum(a.output_tokens), 0)::bigint AS output_tokens
FROM job_attempts a
JOIN jobs j ON j.id = a.job_id
JOIN tenants t ON t.id = j.tenant_id
WHERE a.started_at >= clock_timestamp() - make_interval(secs => %(window_seconds)s)
                      - interval '2 days'
  AND (a.finished_at IS NULL
       OR a.finished_at >= clock_timestamp() - make_interval(secs => %(window_seconds)s))
GROUP BY t.name, j.priority
ORDER BY t.name, j.priority;

-- name: ops_health
-- `calmq health`: the server answers, and which calmq schema it holds.
SELECT current_setting('server_version') AS server_version,
       (SELECT max(version) FROM calmq_migrations) AS schema_version;

-- name: ops_job_costs
-- Cost per job and per accepted job, and the prompt cache's share, per workflow and tenant,
-- of the jobs that ended within the window (`calmq costs`, the console's overview). A job's
-- cost is every attempt of every step: retries, the calls before a review, the models a
-- fallback moved to. Ended: completed (accepted) or dead-lettered (cancelled jobs are
-- left out, as in calmq_job_cost_jobs_total). The partial index of the retention sweep
-- (jobs_retention: terminal jobs not redacted yet) serves the window; a job redacted within
-- it is no longer counted.
SELECT j.workflow, t.name AS tenant,
       count(*)::bigint AS jobs,
       coalesce(sum(j.cost_usd), 0)::float8 AS cost_usd,
       count(*) FILTER (WHERE j.status = 'completed')::bigint AS accepted,
       coalesce(sum(j.cost_usd) FILTER (WHERE j.status = 'completed'), 0)::float8
           AS accepted_cost_usd,
       coalesce(sum(j.input_tokens), 0)::bigint AS input_tokens,
       coalesce(sum(j.cached_input_tokens), 0)::bigint AS cached_input_tokens,
       coalesce(sum(j.cache_write_tokens), 0)::bigint AS cache_write_tokens,
       coalesce(sum(j.cache_saved_usd), 0)::float8 AS cache_saved_usd
FROM jobs j
JOIN tenants t ON t.id = j.tenant_id
WHERE j.redacted_at IS NULL AND j.status IN ('completed', 'dead_letter', 'cancelled')
  AND j.status <> 'cancelled'
  AND j.updated_at >= clock_timestamp() - make_interval(secs => %(window_seconds)s)
  AND (%(tenant_id)s::uuid IS NULL OR j.tenant_id = %(tenant_id)s::uuid)
  AND (%(tenant)s::text IS NULL OR t.name = %(tenant)s::text)
  AND (%(workflow)s::text IS NULL OR j.workflow = %(workflow)s::text)
GROUP BY j.workflow, t.name
ORDER BY j.workflow, t.name;
