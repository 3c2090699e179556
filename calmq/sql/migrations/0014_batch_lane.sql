-- The batch lane (issue 19; docs/how-to/batch-backfills.md): a job may wait for the
-- providers' batch APIs (OpenAI Batch, Anthropic Message Batches) at about half the price.
-- ``lane`` says which lane its job.requested goes to: calmq.<pool>.<priority> (online) or
-- calmq.<pool>.batch. Kept apart from ``priority`` on purpose: the job.requested schema's
-- Priority enum may not grow a symbol (schemas/README.md), and a batch job is bulk work.
ALTER TABLE jobs ADD COLUMN lane text NOT NULL DEFAULT 'online'
    CHECK (lane IN ('online', 'batch'));

-- One provider batch. ``key`` is calmq's own id, written BEFORE the provider is asked to
-- create the batch and sent with it (OpenAI: metadata.calmq_key), so a batcher killed
-- between the provider's answer and the commit that records its id finds the batch again
-- on restart instead of creating a second one. ``provider_id`` is NULL until then.
CREATE TABLE provider_batches (
    key               uuid PRIMARY KEY,
    provider          text NOT NULL,
    model             text NOT NULL,
    endpoint          text NOT NULL,
    pool              text NOT NULL,
    provider_id       text UNIQUE,
    -- creating: recorded, not yet known to be at the provider; submitted: the provider has
    -- it; collected: every job of it settled; abandoned: never created at the provider
    state             text NOT NULL DEFAULT 'creating'
                      CHECK (state IN ('creating', 'submitted', 'collected', 'abandoned')),
    provider_status   text,
    request_count     integer NOT NULL,
    input_bytes       bigint NOT NULL DEFAULT 0,
    enqueued_tokens   bigint NOT NULL DEFAULT 0,
    -- the poller holding it (one per batch at a time) and until when
    lease_owner       text,
    lease_expires_at  timestamptz,
    next_poll_at      timestamptz NOT NULL DEFAULT now(),
    created_at        timestamptz NOT NULL DEFAULT now(),
    submitted_at      timestamptz,
    ended_at          timestamptz,
    collected_at      timestamptz,
    counts            jsonb NOT NULL DEFAULT '{}'::jsonb,
    cancel_requested  boolean NOT NULL DEFAULT false
);
CREATE INDEX provider_batches_open ON provider_batches (next_poll_at)
    WHERE state IN ('creating', 'submitted');

-- Which attempt of which job is in which batch: custom_id is "<job id>:<attempt>", so the
-- result of an earlier attempt (a batch that expired and was retried) never settles a later
-- one. ``request`` is the exact request body sent (re-uploaded if the batch must be created
-- again); ``state`` follows the request: pending -> settled | retried | cancelled.
CREATE TABLE batch_jobs (
    batch_key         uuid NOT NULL REFERENCES provider_batches (key) ON DELETE CASCADE,
    job_id            uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    attempt           integer NOT NULL,
    custom_id         text NOT NULL,
    request           jsonb NOT NULL,
    state             text NOT NULL DEFAULT 'pending'
                      CHECK (state IN ('pending', 'settled', 'retried', 'cancelled')),
    input_tokens      bigint NOT NULL DEFAULT 0,
    output_tokens     bigint NOT NULL DEFAULT 0,
    cost_usd          float8 NOT NULL DEFAULT 0,
    -- what the same tokens would have cost through the online API
    online_cost_usd   float8 NOT NULL DEFAULT 0,
    settled_at        timestamptz,
    PRIMARY KEY (batch_key, job_id, attempt)
);
CREATE INDEX batch_jobs_job ON batch_jobs (job_id);
