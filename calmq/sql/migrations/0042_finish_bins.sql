-- Jobs finished per tenant and 5-minute bin, by how they ended, with what they cost, kept as
-- their history is written: the console overview's throughput (console_outcomes) and the
-- cost of the jobs dead-lettered per hour (console_spend). Both read the history of the
-- window joined to the jobs at each view: the last hour's completed and dead_lettered
-- events (52 ms for the largest tenant at 1 M jobs, growing with the hourly volume), and
-- the attempts of every dead letter of the last 24 hours (26 ms at 5 M, growing with the
-- day's dead letters).
--
-- The history trigger (0009) now also appends, per INSERT into job_events, the completed
-- and dead_lettered events' jobs and their cost (the job's, retries included, as the same
-- statement wrote it) to finish_bin_deltas, which the spend release pass folds into
-- finish_bins. Insert only, as spend_deltas (0038): concurrent finishes never wait on a
-- shared row.
--
-- Replacing the function and creating the tables takes no lock on job_events; 0043 writes
-- the last day's bins from before this file without one.
SET LOCAL lock_timeout = '5s';

CREATE TABLE finish_bins (
    bin       timestamptz NOT NULL,  -- the event's time, binned to 5 minutes from the epoch
    tenant_id uuid        NOT NULL,
    type      text        NOT NULL,  -- completed | dead_lettered
    jobs      bigint      NOT NULL,
    cost_usd  numeric     NOT NULL,  -- what those jobs cost, every attempt of theirs
    PRIMARY KEY (bin, tenant_id, type)
);

CREATE TABLE finish_bin_deltas (
    bin       timestamptz NOT NULL,
    tenant_id uuid        NOT NULL,
    type      text        NOT NULL,
    jobs      bigint      NOT NULL,
    cost_usd  numeric     NOT NULL
);

CREATE OR REPLACE FUNCTION calmq_job_events_notify() RETURNS trigger LANGUAGE plpgsql AS $$
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
    IF EXISTS (SELECT 1 FROM new_events
               WHERE type IN ('completed', 'dead_lettered', 'cancelled')) THEN
        -- Each ended job read once, for its webhook delivery and its bin.
        WITH ended AS MATERIALIZED (
            SELECT e.id, e.job_id, e.type, e.at, j.tenant_id, j.callback_url, j.cost_usd
            FROM new_events e
            CROSS JOIN LATERAL (SELECT k.tenant_id, k.callback_url, k.cost_usd FROM jobs k
                                WHERE k.id = e.job_id OFFSET 0) j
            WHERE e.type IN ('completed', 'dead_lettered', 'cancelled')
        ), binned AS (
            INSERT INTO finish_bin_deltas (bin, tenant_id, type, jobs, cost_usd)
            SELECT date_bin('5 minutes', at, 'epoch'::timestamptz), tenant_id, type,
                   count(*), sum(cost_usd)
            FROM ended
            WHERE type IN ('completed', 'dead_lettered')
            GROUP BY 1, 2, 3
        )
        INSERT INTO webhook_deliveries (job_id, tenant_id, url, event_type, event_id)
        SELECT job_id, tenant_id, callback_url, type, id
        FROM ended
        WHERE callback_url IS NOT NULL;
        IF FOUND THEN  -- the webhook deliveries (the statement's own rows)
            PERFORM pg_notify('calmq_webhooks', '');
        END IF;
    END IF;
    RETURN NULL;
END
$$;
