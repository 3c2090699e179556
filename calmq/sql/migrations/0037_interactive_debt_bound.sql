-- A tenant's interactive calls may take its token quota into debt, but only so far: past
-- p_debt tokens below what the call needs they wait like bulk calls (and ahead of them,
-- needing p_debt fewer tokens). Migration 0012's boolean form, unbounded debt, stays for
-- workers of the previous release during a rolling upgrade.
CREATE FUNCTION calmq_tenant_tokens_take(
    p_tenant uuid, p_need double precision, p_rate double precision, p_cap double precision,
    p_debt double precision, OUT granted boolean, OUT wait_seconds double precision)
LANGUAGE plpgsql AS $$
DECLARE
    now_   timestamptz := clock_timestamp();
    level  double precision;
    enough double precision := least(p_need, p_cap) - greatest(p_debt, 0);
BEGIN
    INSERT INTO tenant_token_buckets (tenant_id, tokens, refilled_at)
    VALUES (p_tenant, p_cap, now_) ON CONFLICT (tenant_id) DO NOTHING;
    SELECT least(p_cap, b.tokens + p_rate * greatest(0, extract(epoch FROM now_ - b.refilled_at)))
    INTO level FROM tenant_token_buckets b WHERE b.tenant_id = p_tenant FOR UPDATE;
    granted := level >= enough;
    wait_seconds := CASE WHEN granted OR p_rate <= 0 THEN 0 ELSE (enough - level) / p_rate END;
    UPDATE tenant_token_buckets
    SET tokens = level - CASE WHEN granted THEN p_need ELSE 0 END, refilled_at = now_
    WHERE tenant_id = p_tenant;
END $$;
