-- Each tenant's share of a provider batch (issue 42): what the batch lane's spend caps and
-- the tenant's batch list read, without reading every request of every batch.
--
-- Batch spend used to be recorded only when a batch's results came back, hours after it
-- was packed: a tenant at $0 of a $10 cap could pack 200,000 requests first. Now each
-- request's estimated cost (its prompt's estimate and its max output tokens, at the batch
-- price) is reserved when it is packed (batch_jobs.reserved_usd), and its tenant's sum is
-- kept here (reserved_usd, on reserved_day, the UTC day the attempts started). The spend
-- caps count it as spent (spend_by_tenant) until the request's result settles it: the
-- real cost is then written with the attempt and the reservation drops by the estimate.
-- A batch that ends (collected: failed, expired, cancelled or done) keeps no reservation.
--
-- GET /v1/batches reads the tenant's own rows here (batch_tenants_list) newest first, and
-- the counts and costs of its share; it used to walk every batch, newest first, and count
-- each one's requests to find the tenant's.
--
-- batch_jobs gets a column with a constant default (no rewrite); 0050 fills in the rows of
-- the batches recorded before this, without a lock on batch_jobs.
SET LOCAL lock_timeout = '5s';

ALTER TABLE batch_jobs ADD COLUMN reserved_usd numeric NOT NULL DEFAULT 0;

CREATE TABLE batch_tenants (
    batch_key        uuid        NOT NULL REFERENCES provider_batches (key) ON DELETE CASCADE,
    tenant_id        uuid        NOT NULL,
    created_at       timestamptz NOT NULL,  -- the batch's, for the list's order
    requests         integer     NOT NULL,  -- the tenant's requests in the batch
    settled          integer     NOT NULL DEFAULT 0,
    retried          integer     NOT NULL DEFAULT 0,
    cancelled        integer     NOT NULL DEFAULT 0,
    cost_usd         float8      NOT NULL DEFAULT 0,
    online_cost_usd  float8      NOT NULL DEFAULT 0,
    reserved_day     date        NOT NULL,
    reserved_usd     numeric     NOT NULL DEFAULT 0 CHECK (reserved_usd >= 0),
    PRIMARY KEY (batch_key, tenant_id)
);
CREATE INDEX batch_tenants_list ON batch_tenants (tenant_id, created_at DESC, batch_key DESC);
-- The open reservations only: a handful of rows (open batches x their tenants), read by
-- every spend-cap refresh.
CREATE INDEX batch_tenants_reserved ON batch_tenants (tenant_id)
    INCLUDE (reserved_day, reserved_usd) WHERE reserved_usd > 0;
