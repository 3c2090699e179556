-- The intake API's notifications, webhooks, deletion and key retention (issue 6).

-- Per-tenant secret that signs webhook callbacks, so one tenant cannot forge another's.
-- gen_random_uuid() draws from the strong random source; two of them give 244 random bits.
ALTER TABLE tenants ADD COLUMN webhook_secret text NOT NULL
    DEFAULT replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', '');

-- A redacted job keeps its shape and history (for audit) but none of its data.
ALTER TABLE jobs ADD COLUMN redacted_at timestamptz;

-- The retention sweep deletes keys by age.
CREATE INDEX idempotency_keys_created ON idempotency_keys (created_at);
-- The job retention sweep finds old terminal jobs that still hold data.
CREATE INDEX jobs_retention ON jobs (updated_at)
    WHERE redacted_at IS NULL AND status IN ('completed', 'dead_letter', 'cancelled');

-- One row per callback to deliver; attempts are recorded in webhook_attempts.
CREATE TABLE webhook_deliveries (
    id            bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    job_id        uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    tenant_id     uuid NOT NULL REFERENCES tenants (id),
    url           text NOT NULL,
    event_type    text NOT NULL,
    event_id      bigint NOT NULL,
    status        text NOT NULL DEFAULT 'pending'
                  CHECK (status IN ('pending', 'delivered', 'failed')),
    attempts      integer NOT NULL DEFAULT 0,
    next_at       timestamptz NOT NULL DEFAULT now(),
    created_at    timestamptz NOT NULL DEFAULT now(),
    finished_at   timestamptz,
    UNIQUE (event_id)
);
CREATE INDEX webhook_deliveries_due ON webhook_deliveries (next_at) WHERE status = 'pending';

CREATE TABLE webhook_attempts (
    delivery_id   bigint NOT NULL REFERENCES webhook_deliveries (id) ON DELETE CASCADE,
    attempt       integer NOT NULL,
    at            timestamptz NOT NULL DEFAULT now(),
    status_code   integer,            -- null: no HTTP answer (refused, timeout, connection)
    error         text,
    duration_ms   integer NOT NULL,
    PRIMARY KEY (delivery_id, attempt)
);

-- Wake SSE streams and the webhook dispatcher from the job_events insert path.
-- 'queued' is skipped on purpose: it is written by every submit (the hot path; NOTIFY
-- serialises committing transactions), and an SSE stream reads the history from the table
-- after it subscribes, so it never needs a wake-up for the first event.
CREATE FUNCTION calmq_job_event_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('calmq_job_events', NEW.job_id::text);
    IF NEW.type IN ('completed', 'dead_lettered', 'cancelled') THEN
        INSERT INTO webhook_deliveries (job_id, tenant_id, url, event_type, event_id)
        SELECT j.id, j.tenant_id, j.callback_url, NEW.type, NEW.id
        FROM jobs j WHERE j.id = NEW.job_id AND j.callback_url IS NOT NULL;
        IF FOUND THEN
            PERFORM pg_notify('calmq_webhooks', '');
        END IF;
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER job_events_notify AFTER INSERT ON job_events
    FOR EACH ROW WHEN (NEW.type <> 'queued') EXECUTE FUNCTION calmq_job_event_notify();
