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
-- Statement-level, with a transition table: a batch claim or a group commit of finishes
-- sends one NOTIFY per ~200 jobs (payload: comma-separated job ids, under the 8000-byte
-- limit), not one per event; every API process receives every notification, so fewer and
-- fuller ones keep both the committing transaction and the listeners cheap.
-- 'queued' is skipped: it is written by every submit (the hot path), and an SSE stream reads
-- the history from the table after it subscribes, so it never needs a wake-up for it.
CREATE FUNCTION calmq_job_events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    ids text;
BEGIN
    FOR ids IN
        SELECT string_agg(job_id::text, ',')
        FROM (SELECT job_id, (row_number() OVER ()) / 200 AS chunk
              FROM (SELECT DISTINCT job_id FROM new_events WHERE type <> 'queued') d) c
        GROUP BY chunk
    LOOP
        PERFORM pg_notify('calmq_job_events', ids);
    END LOOP;
    INSERT INTO webhook_deliveries (job_id, tenant_id, url, event_type, event_id)
    SELECT j.id, j.tenant_id, j.callback_url, e.type, e.id
    FROM new_events e JOIN jobs j ON j.id = e.job_id
    WHERE e.type IN ('completed', 'dead_lettered', 'cancelled')
      AND j.callback_url IS NOT NULL;
    IF FOUND THEN
        PERFORM pg_notify('calmq_webhooks', '');
    END IF;
    RETURN NULL;
END
$$;

CREATE TRIGGER job_events_notify AFTER INSERT ON job_events
    REFERENCING NEW TABLE AS new_events
    FOR EACH STATEMENT EXECUTE FUNCTION calmq_job_events_notify();
