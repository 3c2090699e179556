-- Rate limits per concurrency key (issue 31, calmq.rate_keys): one token bucket per tenant,
-- key and workflow (the scope whose Workflow.key_rate_limit applies), fleet-wide. requests
-- and tokens are what is left now (tokens may go below 0: a call that used more than its
-- estimate puts the key in debt, as the fleet budget does); refilled_at: when they were.
-- A worker reserves a call's request and token estimate in one statement (the row's lock
-- makes two workers take turns) and settles the tokens with what the provider counted.
-- last_taken: whether the last reservation fitted (its caller reads it back).
CREATE TABLE IF NOT EXISTS key_rate_buckets (
    tenant_id uuid NOT NULL,
    key text NOT NULL,
    scope text NOT NULL,
    requests float8 NOT NULL,
    tokens float8 NOT NULL,
    refilled_at timestamptz NOT NULL,
    last_taken boolean NOT NULL DEFAULT true,
    PRIMARY KEY (tenant_id, key, scope)
);

-- What a bucket holds at ``at``: ``held`` at ``since``, refilled by ``cap`` every ``per``
-- seconds, never past ``cap`` (calmq/sql/rate_keys.sql).
CREATE OR REPLACE FUNCTION calmq_refilled(held float8, cap float8, since timestamptz,
                                          at timestamptz, per float8)
RETURNS float8 LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT least(cap, held + greatest(0, extract(epoch FROM at - since)) * cap / per)
$$;
