-- Tokens and cost per tenant and UTC hour, kept as attempts' usage is written, for the
-- console's overview (console_spend). It summed the last 24 hours' attempts of every tenant
-- joined to their jobs at each page view: 4.2 s at p50 for the largest tenant at 20 M jobs
-- (BENCHMARKS.md, "Month six"), growing with the daily volume.
--
-- The spend trigger of 0038 now also appends what each UPDATE of job_attempts changed of
-- the attempts' tokens, cost and cost of attempts that did not complete (the retries'
-- share) to spend_hour_deltas, which the spend release pass folds into spend_hours. A table
-- of its own rather than columns of spend_deltas: the release pass of the previous release
-- folds (and deletes) every row of spend_deltas, and would drop the hours during a rolling
-- upgrade. What dead-lettered jobs cost is not kept here: a job's dead-lettering comes after
-- its attempts, and 0042 keeps it with the finished jobs.
--
-- Replacing the function and creating the tables takes no lock on job_attempts; 0041 writes
-- the last day's hours from before this file without one.
SET LOCAL lock_timeout = '5s';

CREATE TABLE spend_hours (
    hour           timestamptz NOT NULL,  -- the UTC hour the attempts started
    tenant_id      uuid        NOT NULL,
    tokens         bigint      NOT NULL,  -- input and output
    cost_usd       numeric     NOT NULL,
    retry_cost_usd numeric     NOT NULL,  -- of attempts whose outcome is not completed
    PRIMARY KEY (hour, tenant_id)
);

CREATE TABLE spend_hour_deltas (
    hour           timestamptz NOT NULL,
    tenant_id      uuid        NOT NULL,
    tokens         bigint      NOT NULL,
    cost_usd       numeric     NOT NULL,
    retry_cost_usd numeric     NOT NULL
);

CREATE OR REPLACE FUNCTION calmq_spend_deltas() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Each changed attempt's difference in tokens, cost and retry cost: the difference of
    -- what the two row versions say, so an outcome written apart from the cost counts too.
    WITH changed AS (
        SELECT n.started_at, j.tenant_id,
               (n.input_tokens + n.output_tokens) - (o.input_tokens + o.output_tokens)
                   AS tokens,
               n.cost_usd - o.cost_usd AS cost_usd,
               CASE WHEN n.outcome IS DISTINCT FROM 'completed' THEN n.cost_usd ELSE 0 END
               - CASE WHEN o.outcome IS DISTINCT FROM 'completed' THEN o.cost_usd ELSE 0 END
                   AS retry_cost_usd
        FROM new_attempts n
        JOIN old_attempts o ON o.job_id = n.job_id AND o.step = n.step
                           AND o.attempt = n.attempt AND o.started_at = n.started_at
        JOIN jobs j ON j.id = n.job_id
        WHERE n.cost_usd <> o.cost_usd OR n.input_tokens <> o.input_tokens
           OR n.output_tokens <> o.output_tokens
           OR (n.outcome IS DISTINCT FROM o.outcome AND n.cost_usd <> 0)
    ), days AS (
        -- What 0038 appended: the spend caps' days.
        INSERT INTO spend_deltas (day, tenant_id, cost_usd)
        SELECT (started_at AT TIME ZONE 'UTC')::date, tenant_id, sum(cost_usd)
        FROM changed WHERE cost_usd <> 0
        GROUP BY 1, 2
    )
    INSERT INTO spend_hour_deltas (hour, tenant_id, tokens, cost_usd, retry_cost_usd)
    SELECT date_trunc('hour', started_at AT TIME ZONE 'UTC') AT TIME ZONE 'UTC', tenant_id,
           sum(tokens), sum(cost_usd), sum(retry_cost_usd)
    FROM changed
    GROUP BY 1, 2;
    RETURN NULL;
END $$;
