-- calmq schema, version 12 (issues 15 and 19): per-tenant token quotas and spend caps.
--
-- A tenant's token quota is a bucket of its own in front of the fleet's shared buckets
-- (migration 0005): a model call takes its estimate from the tenant's bucket first, so one
-- tenant's flood is held at its quota and cannot drain (or put into debt) the bulk bucket
-- every other tenant shares. tokens_per_minute NULL: the tenant gets the default fair share
-- (setting budget_tenant_share of the fleet's tokens per minute); 0: no quota of its own.
ALTER TABLE tenants
    ADD COLUMN tokens_per_minute      bigint CHECK (tokens_per_minute >= 0),
    ADD COLUMN spend_cap_daily_usd    numeric(20, 6) CHECK (spend_cap_daily_usd >= 0),
    ADD COLUMN spend_cap_monthly_usd  numeric(20, 6) CHECK (spend_cap_monthly_usd >= 0);

-- One row per tenant, created on the tenant's first call. The refill is computed from the
-- database clock at every touch (as budget_buckets'), from the rate the caller passes: the
-- rate follows the tenant's setting and the fleet's, which may change between calls.
CREATE TABLE tenant_token_buckets (
    tenant_id    uuid PRIMARY KEY,  -- no foreign key: a call of a hand-made job has a tenant id too
    tokens       double precision NOT NULL,             -- may go negative: a debt
    refilled_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- Take p_need tokens for one call of the tenant, refilling at p_rate tokens a second up to
-- p_cap. Granted when the balance covers the call, or when the bucket is full (a call larger
-- than the bucket ever holds goes once the bucket is full and leaves it in debt: it waits its
-- turn instead of for ever), or always with p_debt (an interactive call: it is counted, and
-- the tenant's bulk calls wait for the debt). Otherwise nothing is taken and wait_seconds
-- says when it will be.
CREATE FUNCTION calmq_tenant_tokens_take(
    p_tenant uuid, p_need double precision, p_rate double precision, p_cap double precision,
    p_debt boolean, OUT granted boolean, OUT wait_seconds double precision)
LANGUAGE plpgsql AS $$
DECLARE
    now_   timestamptz := clock_timestamp();
    level  double precision;
BEGIN
    INSERT INTO tenant_token_buckets (tenant_id, tokens, refilled_at)
    VALUES (p_tenant, p_cap, now_) ON CONFLICT (tenant_id) DO NOTHING;
    SELECT least(p_cap, b.tokens + p_rate * greatest(0, extract(epoch FROM now_ - b.refilled_at)))
    INTO level FROM tenant_token_buckets b WHERE b.tenant_id = p_tenant FOR UPDATE;
    granted := p_debt OR level >= least(p_need, p_cap);
    wait_seconds := CASE WHEN granted OR p_rate <= 0 THEN 0
                         ELSE (least(p_need, p_cap) - level) / p_rate END;
    UPDATE tenant_token_buckets
    SET tokens = level - CASE WHEN granted THEN p_need ELSE 0 END, refilled_at = now_
    WHERE tenant_id = p_tenant;
END $$;

-- Spend caps: work of a tenant past its cap (or of the fleet past the fleet's) waits in its
-- status with a reason instead of being claimed; the reason is cleared, and a fresh
-- job.requested written through the outbox, once the window rolls over or the cap is raised.
-- The sweeper leaves waiting jobs alone (they have no message on purpose).
ALTER TABLE jobs ADD COLUMN waiting_reason text;
CREATE INDEX jobs_waiting_reason ON jobs (tenant_id, created_at)
    WHERE waiting_reason IS NOT NULL;
-- The spend of a window is summed from the attempts that started in it.
CREATE INDEX job_attempts_started ON job_attempts (started_at);
