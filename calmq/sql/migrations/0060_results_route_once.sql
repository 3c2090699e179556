-- The results route's cost per job (issue 48): outbox_tenant_route (0056) ran a plpgsql call,
-- a case-insensitive regex and a lookup of tenants for every job.result and dead letter,
-- about 20 us of PostgreSQL CPU per job (one row per job, bench e2e), whether or not any
-- tenant has a results topic of its own.
--
-- Now the trigger runs once per transaction while no tenant has one: its first call finds
-- none (one probe of the partial index below) and says so in a transaction-local setting,
-- calmq.results_topics = 'none', which the trigger's WHEN reads for every later row of the
-- transaction without calling the function. Once some tenant has a topic the setting is
-- 'some' and every row is looked up as before. What a row is routed by:
-- - a transaction that writes a results row after a tenant's topic was set and committed
--   (the worker's group commit, a review, a cancel, the reaper: each a transaction of its
--   own) routes it to that topic, as before;
-- - a transaction that sets or clears a tenant's topic itself forgets what it said (the
--   tenants trigger below), so its later rows are looked up;
-- - a transaction that had already said 'none' keeps it for its own later rows while a
--   concurrent one sets a topic: those rows would have raced the change anyway.
SET LOCAL lock_timeout = '5s';

CREATE INDEX IF NOT EXISTS tenants_results_topic ON tenants (id) WHERE results_topic IS NOT NULL;

CREATE OR REPLACE FUNCTION calmq_outbox_tenant_route() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    topic text;
BEGIN
    IF current_setting('calmq.results_topics', true) IS DISTINCT FROM 'some' THEN
        IF NOT EXISTS (SELECT 1 FROM tenants t WHERE t.results_topic IS NOT NULL) THEN
            PERFORM set_config('calmq.results_topics', 'none', true);
            RETURN NEW;
        END IF;
        PERFORM set_config('calmq.results_topics', 'some', true);
    END IF;
    IF NEW.payload->>'tenant_id' ~* '^[0-9a-f]{8}-([0-9a-f]{4}-){3}[0-9a-f]{12}$' THEN
        SELECT t.results_topic INTO topic FROM tenants t
        WHERE t.id = (NEW.payload->>'tenant_id')::uuid;
        IF topic IS NOT NULL THEN
            -- The route is the topic without calmq.'s prefix (calmq.topics.topic_for_route).
            NEW.aggregatetype := substr(topic, length('calmq.') + 1)
                || CASE WHEN NEW.aggregatetype = 'dlq' THEN '.dlq' ELSE '' END;
        END IF;
    END IF;
    RETURN NEW;
END $$;

DROP TRIGGER IF EXISTS outbox_tenant_route ON outbox;
CREATE TRIGGER outbox_tenant_route BEFORE INSERT ON outbox
    FOR EACH ROW WHEN (NEW.aggregatetype IN ('results', 'dlq')
                       AND current_setting('calmq.results_topics', true)
                           IS DISTINCT FROM 'none')
    EXECUTE FUNCTION calmq_outbox_tenant_route();

-- A transaction that gives a tenant a results topic (or takes it away) looks the tenants up
-- again for its own later rows.
CREATE OR REPLACE FUNCTION calmq_results_topics_changed() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM set_config('calmq.results_topics', '', true);
    RETURN NULL;
END $$;

DROP TRIGGER IF EXISTS tenants_results_topics_changed ON tenants;
CREATE TRIGGER tenants_results_topics_changed AFTER INSERT OR UPDATE OF results_topic ON tenants
    FOR EACH STATEMENT EXECUTE FUNCTION calmq_results_topics_changed();
