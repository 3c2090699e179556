-- What each tenant spent per UTC day, kept as attempts' cost is written, for the spend caps
-- (calmq.spending). Their read summed the month's attempts joined to their jobs, in every
-- worker every spend_cap_refresh_seconds: 0.38 s at 1 M jobs three days into a month, and a
-- month of attempts at scale (BENCHMARKS.md, "Month six").
--
-- A statement-level trigger on job_attempts appends what each UPDATE changed of the
-- attempts' cost to spend_deltas: insert only, so concurrent finishes never wait on each
-- other's row. The spend release pass (one at a time in the fleet) folds the deltas into
-- spend_days. A trigger rather than the two statements that write cost, so that workers of
-- the previous release count too during a rolling upgrade. Attempts are inserted at cost 0
-- and a deleted attempt's cost stays spent, so UPDATE is the only event.
--
-- This file takes a short lock on job_attempts (creating the trigger); 0039 writes what the
-- month spent before it, without one.
SET LOCAL lock_timeout = '5s';

CREATE TABLE spend_days (
    day       date    NOT NULL,  -- the UTC day the attempts started
    tenant_id uuid    NOT NULL,
    cost_usd  numeric NOT NULL,
    PRIMARY KEY (day, tenant_id)
);

CREATE TABLE spend_deltas (
    day       date    NOT NULL,
    tenant_id uuid    NOT NULL,
    cost_usd  numeric NOT NULL
);

CREATE FUNCTION calmq_spend_deltas() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO spend_deltas (day, tenant_id, cost_usd)
    SELECT (n.started_at AT TIME ZONE 'UTC')::date, j.tenant_id,
           sum(n.cost_usd - o.cost_usd)
    FROM new_attempts n
    JOIN old_attempts o ON o.job_id = n.job_id AND o.step = n.step
                       AND o.attempt = n.attempt AND o.started_at = n.started_at
    JOIN jobs j ON j.id = n.job_id
    WHERE n.cost_usd <> o.cost_usd
    GROUP BY 1, 2;
    RETURN NULL;
END $$;

CREATE TRIGGER job_attempts_spend AFTER UPDATE ON job_attempts
    REFERENCING OLD TABLE AS old_attempts NEW TABLE AS new_attempts
    FOR EACH STATEMENT EXECUTE FUNCTION calmq_spend_deltas();
