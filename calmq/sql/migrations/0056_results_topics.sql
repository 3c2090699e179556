-- Results per tenant (issue 44): a tenant's job.result and job.dead_lettered events go to a
-- topic of its own, so its downstream service reads its own results and may be allowed to
-- read nothing else (an ACL on that topic alone). NULL: the shared calmq.results / calmq.dlq.
ALTER TABLE tenants ADD COLUMN results_topic text
    CONSTRAINT tenants_results_topic_name
    CHECK (results_topic ~ '^calmq\.results\.[A-Za-z0-9._-]{1,200}$');

-- The route is rewritten here, as the row is written, rather than where each event is built:
-- every path that emits a result (a worker's finished attempts, a review, a cancel, a
-- reaper's dead letter) goes through this one table, and the row then carries its topic, so
-- Debezium's outbox router (topic by aggregatetype) publishes it where calmq's relay does.
-- A dead letter goes to the results topic's ".dlq" twin. The tenant id is the payload's
-- (every job.result and job's job.dead_lettered has one); a row without one stays shared.
CREATE FUNCTION calmq_outbox_tenant_route() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    topic text;
BEGIN
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

CREATE TRIGGER outbox_tenant_route BEFORE INSERT ON outbox
    FOR EACH ROW WHEN (NEW.aggregatetype IN ('results', 'dlq'))
    EXECUTE FUNCTION calmq_outbox_tenant_route();
