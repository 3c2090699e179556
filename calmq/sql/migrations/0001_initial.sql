-- calmq schema, version 1: tenants and keys, jobs with their history and attempts,
-- idempotency keys, and the transactional outbox.

CREATE TABLE tenants (
    id          uuid PRIMARY KEY,
    name        text NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now()
);

-- Keys are 32 random bytes; a SHA-256 of the key is enough to store (no password stretching
-- needed for high-entropy secrets) and lets the API look a key up by its hash.
CREATE TABLE api_keys (
    id          uuid PRIMARY KEY,
    tenant_id   uuid NOT NULL REFERENCES tenants (id),
    key_hash    bytea NOT NULL UNIQUE,
    key_prefix  text NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    revoked_at  timestamptz
);

CREATE TABLE jobs (
    id                uuid PRIMARY KEY,
    tenant_id         uuid NOT NULL REFERENCES tenants (id),
    workflow          text NOT NULL,
    workflow_version  integer NOT NULL,
    status            text NOT NULL CHECK (status IN ('queued', 'running', 'retrying',
                          'awaiting_review', 'completed', 'dead_letter', 'cancelled')),
    priority          text NOT NULL CHECK (priority IN ('interactive', 'bulk')),
    pool              text NOT NULL,
    step              text NOT NULL,
    attempt           integer NOT NULL DEFAULT 0,   -- attempts of the current step so far
    max_attempts      integer NOT NULL,
    input             jsonb,                         -- small inputs live in the row
    input_ref         text,                          -- large inputs live in the object store
    metadata          jsonb NOT NULL DEFAULT '{}',
    callback_url      text,
    deadline_at       timestamptz,
    artifact          jsonb,                         -- {uri, sha256, content_type, size}
    error             jsonb,                         -- {code, class, message}
    errors            jsonb NOT NULL DEFAULT '[]',   -- every failed attempt, oldest first
    lease_owner       text,
    lease_expires_at  timestamptz,
    trace_parent      text,
    created_at        timestamptz NOT NULL DEFAULT now(),
    updated_at        timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX jobs_tenant_created ON jobs (tenant_id, created_at DESC, id);
CREATE INDEX jobs_leased ON jobs (lease_expires_at) WHERE status = 'running';

CREATE TABLE job_events (
    id        bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id    uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    type      text NOT NULL,
    at        timestamptz NOT NULL DEFAULT clock_timestamp(),
    attempt   integer NOT NULL,
    detail    jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX job_events_job ON job_events (job_id, id);

-- One row per attempt of a step: the evidence a person reads before a redrive.
CREATE TABLE job_attempts (
    job_id        uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    step          text NOT NULL,
    attempt       integer NOT NULL,
    worker        text NOT NULL,
    started_at    timestamptz NOT NULL,
    finished_at   timestamptz,
    outcome       text,           -- completed | failed | abandoned
    error_code    text,
    error_class   text,
    error_message text,
    PRIMARY KEY (job_id, step, attempt)
);

CREATE TABLE idempotency_keys (
    tenant_id     uuid NOT NULL REFERENCES tenants (id),
    key           text NOT NULL,
    request_hash  bytea NOT NULL,
    job_id        uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    created_at    timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (tenant_id, key)
);

-- The transactional outbox, in the column names of Debezium's Outbox Event Router
-- (id, aggregatetype, aggregateid, type, payload) so its connector can replace the relay.
-- txid and seq give the polling relay a total order it can page through without ever
-- skipping a transaction that commits late (see relay/polling.py).
CREATE TABLE outbox (
    seq            bigint GENERATED ALWAYS AS IDENTITY,
    id             uuid NOT NULL,
    aggregatetype  text NOT NULL,   -- the route: default.interactive, retry.5s, results, dlq
    aggregateid    text NOT NULL,   -- the job id: the Kafka key
    type           text NOT NULL,   -- the event type: job.requested, job.result
    payload        jsonb NOT NULL,  -- the event; the relay encodes it in Avro
    headers        jsonb NOT NULL DEFAULT '{}',
    txid           xid8 NOT NULL DEFAULT pg_current_xact_id(),
    created_at     timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (txid, seq)
);

CREATE TABLE relay_cursor (
    name      text PRIMARY KEY,
    txid      xid8 NOT NULL,
    seq       bigint NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT now()
);
