-- calmq schema, version 5: the fleet-wide token budget, and tokens and cost per attempt and
-- per job.
--
-- One row per provider and model holds two token buckets (bulk, interactive) for tokens and
-- for requests. Workers lease slices of them (calmq_budget_take) and give back what they did
-- not spend (calmq_budget_give_back), so the row is touched a few times a second per worker,
-- not once per model call. The refill is computed from the database clock at every touch,
-- so no process has to tick the buckets and no worker's clock matters.
--
-- The interactive bucket refills at `interactive_share` of the rate; what overflows its
-- (small) capacity refills the bulk bucket. So the share is held back for interactive work
-- while some is waiting, and bulk gets the whole rate when none is: the quota is never idle.
CREATE TABLE budget_buckets (
    provider              text NOT NULL,
    model                 text NOT NULL,
    tokens_per_minute     bigint NOT NULL,            -- as configured; 0: no token limit
    requests_per_minute   bigint NOT NULL,            -- as configured; 0: no request limit
    token_rate            double precision NOT NULL,  -- tokens refilled per second
    request_rate          double precision NOT NULL,
    token_cap             double precision NOT NULL,  -- capacity of both buckets together
    request_cap           double precision NOT NULL,
    interactive_share     double precision NOT NULL CHECK (interactive_share >= 0
                                                           AND interactive_share < 1),
    bulk_tokens           double precision NOT NULL DEFAULT 0,  -- may go negative: a debt
    bulk_requests         double precision NOT NULL DEFAULT 0,
    interactive_tokens    double precision NOT NULL DEFAULT 0,
    interactive_requests  double precision NOT NULL DEFAULT 0,
    refilled_at           timestamptz NOT NULL DEFAULT clock_timestamp(),
    paused_until          timestamptz NOT NULL DEFAULT '-infinity',
    updated_at            timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (provider, model)
);

-- Bring a locked row's four levels up to `at`. Returns the row with new levels (not stored).
CREATE FUNCTION calmq_budget_refill(b budget_buckets, at timestamptz)
RETURNS budget_buckets LANGUAGE plpgsql IMMUTABLE AS $$
DECLARE
    dt    double precision := greatest(0, extract(epoch FROM at - b.refilled_at));
    share double precision := b.interactive_share;
    i     double precision;
BEGIN
    i := b.interactive_tokens + b.token_rate * dt * share;
    b.bulk_tokens := least(b.token_cap * (1 - share),
                           b.bulk_tokens + b.token_rate * dt * (1 - share)
                           + greatest(0, i - b.token_cap * share));
    b.interactive_tokens := least(i, b.token_cap * share);
    i := b.interactive_requests + b.request_rate * dt * share;
    b.bulk_requests := least(b.request_cap * (1 - share),
                             b.bulk_requests + b.request_rate * dt * (1 - share)
                             + greatest(0, i - b.request_cap * share));
    b.interactive_requests := least(i, b.request_cap * share);
    b.refilled_at := at;
    RETURN b;
END $$;

-- Lease a slice: at least one call's worth (p_need_tokens, one request) or nothing, at most
-- p_want_*. Interactive takes from its own bucket first, then from bulk; bulk only from bulk.
-- A call larger than a bucket can ever hold is granted once the bucket is full and leaves it
-- in debt, so a big prompt waits its turn instead of waiting forever. When nothing is
-- granted, wait_seconds says when one call's worth will be there (or when a pause ends).
CREATE FUNCTION calmq_budget_take(
    p_provider text, p_model text, p_priority text,
    p_need_tokens double precision, p_want_tokens double precision,
    p_want_requests double precision,
    OUT granted_tokens double precision, OUT granted_requests double precision,
    OUT wait_seconds double precision, OUT known boolean)
LANGUAGE plpgsql AS $$
DECLARE
    b            budget_buckets;
    now_         timestamptz := clock_timestamp();
    interactive  boolean := p_priority = 'interactive';
    avail_t      double precision;
    avail_r      double precision;
    cap_t        double precision;
    cap_r        double precision;
    rate_t       double precision;
    rate_r       double precision;
    from_i       double precision;
BEGIN
    granted_tokens := 0; granted_requests := 0; wait_seconds := 0; known := true;
    SELECT * INTO b FROM budget_buckets WHERE provider = p_provider AND model = p_model
    FOR UPDATE;
    IF NOT FOUND THEN
        known := false;
        RETURN;
    END IF;
    b := calmq_budget_refill(b, now_);
    IF b.paused_until > now_ THEN
        wait_seconds := extract(epoch FROM b.paused_until - now_);
    ELSE
        -- Interactive may use bulk's balance but not bulk's debt.
        avail_t := CASE WHEN interactive THEN b.interactive_tokens + greatest(0, b.bulk_tokens)
                        ELSE b.bulk_tokens END;
        avail_r := CASE WHEN interactive
                        THEN b.interactive_requests + greatest(0, b.bulk_requests)
                        ELSE b.bulk_requests END;
        cap_t := b.token_cap * CASE WHEN interactive THEN 1 ELSE 1 - b.interactive_share END;
        cap_r := b.request_cap * CASE WHEN interactive THEN 1 ELSE 1 - b.interactive_share END;
        rate_t := b.token_rate * CASE WHEN interactive THEN 1 ELSE 1 - b.interactive_share END;
        rate_r := b.request_rate * CASE WHEN interactive THEN 1 ELSE 1 - b.interactive_share END;
        IF (b.token_rate = 0 OR avail_t >= least(p_need_tokens, cap_t))
           AND (b.request_rate = 0 OR avail_r >= least(1, cap_r)) THEN
            granted_tokens := CASE WHEN b.token_rate = 0 THEN p_want_tokens
                                   ELSE greatest(p_need_tokens, least(p_want_tokens, avail_t)) END;
            granted_requests := CASE WHEN b.request_rate = 0 THEN p_want_requests
                                     ELSE greatest(1, least(p_want_requests, floor(avail_r))) END;
            IF b.token_rate > 0 THEN
                from_i := CASE WHEN interactive
                               THEN least(granted_tokens, greatest(0, b.interactive_tokens))
                               ELSE 0 END;
                b.interactive_tokens := b.interactive_tokens - from_i;
                b.bulk_tokens := b.bulk_tokens - (granted_tokens - from_i);
            END IF;
            IF b.request_rate > 0 THEN
                from_i := CASE WHEN interactive
                               THEN least(granted_requests, greatest(0, b.interactive_requests))
                               ELSE 0 END;
                b.interactive_requests := b.interactive_requests - from_i;
                b.bulk_requests := b.bulk_requests - (granted_requests - from_i);
            END IF;
        ELSE
            wait_seconds := greatest(
                CASE WHEN b.token_rate = 0 THEN 0
                     ELSE (least(p_need_tokens, cap_t) - avail_t) / rate_t END,
                CASE WHEN b.request_rate = 0 THEN 0
                     ELSE (least(1, cap_r) - avail_r) / rate_r END);
        END IF;
    END IF;
    UPDATE budget_buckets SET bulk_tokens = b.bulk_tokens, bulk_requests = b.bulk_requests,
        interactive_tokens = b.interactive_tokens, interactive_requests = b.interactive_requests,
        refilled_at = b.refilled_at
    WHERE provider = p_provider AND model = p_model;
END $$;

-- Give back what a lease did not spend (negative amounts settle a debt: the calls it paid
-- for cost more than was reserved). Never above capacity: a bucket does not bank time.
CREATE FUNCTION calmq_budget_give_back(
    p_provider text, p_model text, p_priority text,
    p_tokens double precision, p_requests double precision)
RETURNS void LANGUAGE plpgsql AS $$
DECLARE
    b    budget_buckets;
    i    double precision;
BEGIN
    SELECT * INTO b FROM budget_buckets WHERE provider = p_provider AND model = p_model
    FOR UPDATE;
    IF NOT FOUND THEN
        RETURN;
    END IF;
    b := calmq_budget_refill(b, clock_timestamp());
    IF p_priority = 'interactive' THEN
        i := b.interactive_tokens + p_tokens;
        b.bulk_tokens := least(b.token_cap * (1 - b.interactive_share),
                               b.bulk_tokens + greatest(0, i - b.token_cap * b.interactive_share));
        b.interactive_tokens := least(i, b.token_cap * b.interactive_share);
        i := b.interactive_requests + p_requests;
        b.bulk_requests := least(b.request_cap * (1 - b.interactive_share),
                                 b.bulk_requests
                                 + greatest(0, i - b.request_cap * b.interactive_share));
        b.interactive_requests := least(i, b.request_cap * b.interactive_share);
    ELSE
        b.bulk_tokens := least(b.token_cap * (1 - b.interactive_share), b.bulk_tokens + p_tokens);
        b.bulk_requests := least(b.request_cap * (1 - b.interactive_share),
                                 b.bulk_requests + p_requests);
    END IF;
    UPDATE budget_buckets SET bulk_tokens = b.bulk_tokens, bulk_requests = b.bulk_requests,
        interactive_tokens = b.interactive_tokens, interactive_requests = b.interactive_requests,
        refilled_at = b.refilled_at
    WHERE provider = p_provider AND model = p_model;
END $$;

-- Tokens and cost: per attempt (the evidence) and summed on the job (retries included).
ALTER TABLE jobs
    ADD COLUMN input_tokens  bigint NOT NULL DEFAULT 0,
    ADD COLUMN output_tokens bigint NOT NULL DEFAULT 0,
    ADD COLUMN cost_usd      numeric(20, 10) NOT NULL DEFAULT 0;
ALTER TABLE job_attempts
    ADD COLUMN model_calls   integer NOT NULL DEFAULT 0,
    ADD COLUMN input_tokens  bigint NOT NULL DEFAULT 0,
    ADD COLUMN output_tokens bigint NOT NULL DEFAULT 0,
    ADD COLUMN cost_usd      numeric(20, 10) NOT NULL DEFAULT 0;
