-- Child jobs and the durable join (issue 43; calmq/data/children.py, docs/how-to/fan-out.md).
--
-- A step may start child jobs (calmq.workflows.Spawn). Each child is an ordinary job row
-- that names its parent (parent_id) and its place among its siblings (child_index: the
-- order the parent's next step receives them in). The parent waits in queued with
-- waiting_reason 'children', holding no lease and no message, and a job_joins row counts
-- its children as they settle.
--
-- The join is decided by a trigger in the transaction that settles a child (a completion,
-- a dead letter, a cancel: whichever statement moves it to a terminal status), never by a
-- poller: the UPDATE ... RETURNING on the join row takes the row's lock, so two children
-- settling at once take turns and exactly one of them sees the policy decided and marks
-- fired_at; every later child finds fired_at set and changes nothing.
--
-- The new columns have no default (no rewrite) and the triggers are created in a moment,
-- but both take a strong lock on jobs: give up rather than queue every writer behind a
-- long transaction (the migration is tried again).
SET LOCAL lock_timeout = '5s';

ALTER TABLE jobs ADD COLUMN IF NOT EXISTS parent_id uuid;
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS child_index integer;
-- The parent's step that started the child: its join (a parent may spawn again in a later
-- step, while children of an earlier join that held early still run).
ALTER TABLE jobs ADD COLUMN IF NOT EXISTS parent_step text;
-- No foreign key: a parent row is never deleted before its children (purge redacts, the
-- retention drops a parent with its children), and a key's check would take a share lock
-- on the parent's row for every child inserted or settled.
-- A new column of only new rows: the index is empty when built, so no CONCURRENTLY needed.
CREATE INDEX IF NOT EXISTS jobs_parent ON jobs (parent_id, child_index)
    WHERE parent_id IS NOT NULL;

CREATE TABLE IF NOT EXISTS job_joins (
    parent_id     uuid NOT NULL,
    -- the step that started the children (its output is recorded with them)
    step          text NOT NULL,
    -- all: every child succeeds; at_least: k of n succeed; all_finish: every child ends,
    -- the failed ones listed
    policy        text NOT NULL CHECK (policy IN ('all', 'at_least', 'all_finish')),
    k             integer NOT NULL,
    n             integer NOT NULL CHECK (n >= 1),
    succeeded     integer NOT NULL DEFAULT 0,
    failed        integer NOT NULL DEFAULT 0,
    -- the parent's events when the join fires: written by the trigger with fresh ids
    -- (built by the worker that spawned, calmq.workflows.progress)
    resume_outbox jsonb NOT NULL,
    fail_outbox   jsonb NOT NULL,
    created_at    timestamptz NOT NULL DEFAULT now(),
    fired_at      timestamptz,
    outcome       text,
    PRIMARY KEY (parent_id, step)
);

-- Children past the parent's in-flight limit (setting children_in_flight_max): written
-- queued with waiting_reason parent_in_flight and no outbox row; their job.requested waits
-- here, and each child that ends releases the next (calmq_settle_child), in input order.
CREATE TABLE IF NOT EXISTS job_held_children (
    job_id      uuid PRIMARY KEY,
    parent_id   uuid NOT NULL,
    child_index integer NOT NULL,
    route       text NOT NULL,
    payload     jsonb NOT NULL,
    headers     jsonb NOT NULL DEFAULT '{}'
);
CREATE INDEX IF NOT EXISTS job_held_children_next ON job_held_children (parent_id, child_index);

-- The outbox rows of a join's events (resume_outbox or fail_outbox): each with a fresh id,
-- which is also its payload's event_id (calmq.data.outbox.entry's rule).
CREATE OR REPLACE FUNCTION calmq_join_outbox(parent uuid, entries jsonb, extra jsonb)
RETURNS void LANGUAGE sql AS $$
    INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers)
    SELECT g.id, e.x ->> 'route', parent::text, e.x ->> 'type',
           (e.x -> 'payload') || jsonb_build_object('event_id', g.id::text)
                              || COALESCE(extra -> (e.x ->> 'type'), '{}'::jsonb),
           COALESCE(e.x -> 'headers', '{}'::jsonb)
    FROM jsonb_array_elements(entries) WITH ORDINALITY AS e(x, n),
         LATERAL (SELECT gen_random_uuid() AS id) g
    ORDER BY e.n
$$;

CREATE OR REPLACE FUNCTION calmq_settle_child() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    j job_joins%ROWTYPE;
    ok boolean := NEW.status = 'completed';
    verdict text;
    failed_ids jsonb;
    err jsonb;
    p jobs%ROWTYPE;
BEGIN
    -- A place in flight is free: the next held sibling goes (SKIP LOCKED: two children
    -- ending at once release two). One cancelled while held is gone with its row.
    WITH next AS (
        DELETE FROM job_held_children h
        WHERE h.job_id = (SELECT n.job_id FROM job_held_children n
                          WHERE n.parent_id = NEW.parent_id
                          ORDER BY n.child_index LIMIT 1 FOR UPDATE SKIP LOCKED)
        RETURNING h.*
    ), freed AS (
        UPDATE jobs c SET waiting_reason = NULL
        FROM next WHERE c.id = next.job_id AND c.status = 'queued'
        RETURNING c.id, c.created_at
    )
    INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers)
    SELECT g.id, n.route, f.id::text, 'job.requested',
           n.payload || jsonb_build_object(
               'event_id', g.id::text,
               'created_at', floor(extract(epoch FROM f.created_at) * 1000)::bigint),
           n.headers
    FROM next n JOIN freed f ON f.id = n.job_id, LATERAL (SELECT gen_random_uuid() AS id) g;

    UPDATE job_joins SET succeeded = succeeded + ok::int, failed = failed + (NOT ok)::int
    WHERE parent_id = NEW.parent_id AND step = NEW.parent_step AND fired_at IS NULL
    RETURNING * INTO j;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    verdict := CASE
        WHEN j.policy = 'all' AND j.failed > 0 THEN 'failed'
        WHEN j.policy = 'all' AND j.succeeded >= j.n THEN 'resumed'
        WHEN j.policy = 'at_least' AND j.succeeded >= j.k THEN 'resumed'
        WHEN j.policy = 'at_least' AND j.n - j.failed < j.k THEN 'failed'
        WHEN j.policy = 'all_finish' AND j.succeeded + j.failed >= j.n THEN 'resumed'
    END;
    IF verdict IS NULL THEN
        RETURN NULL;
    END IF;
    UPDATE job_joins SET fired_at = now(), outcome = verdict
    WHERE parent_id = j.parent_id AND step = j.step;
    -- Named in the parent's history and error: the first thousand, in input order.
    SELECT COALESCE(jsonb_agg(c.id::text ORDER BY c.child_index), '[]'::jsonb)
    INTO failed_ids
    FROM (SELECT id, child_index FROM jobs
          WHERE parent_id = j.parent_id AND parent_step = j.step
            AND status IN ('dead_letter', 'cancelled')
          ORDER BY child_index LIMIT 1000) c;
    IF verdict = 'resumed' THEN
        UPDATE jobs SET waiting_reason = NULL, updated_at = now()
        WHERE id = j.parent_id AND status = 'queued' AND waiting_reason = 'children'
        RETURNING * INTO p;
        IF NOT FOUND THEN  -- cancelled or purged meanwhile: nothing to resume
            RETURN NULL;
        END IF;
        INSERT INTO job_events (job_id, type, attempt, detail)
        VALUES (p.id, 'children_joined', 0, jsonb_build_object(
            'step', j.step, 'policy', j.policy, 'children', j.n,
            'succeeded', j.succeeded, 'failed', j.failed, 'failed_children', failed_ids));
        PERFORM calmq_join_outbox(p.id, j.resume_outbox, '{}'::jsonb);
        RETURN NULL;
    END IF;
    err := jsonb_build_object(
        'code', 'children_failed', 'class', 'input',
        'message', format('the join (%s) of step %s can no longer hold: %s of %s children '
                          'failed (%s)', CASE WHEN j.policy = 'at_least'
                                              THEN format('at least %s', j.k)
                                              ELSE j.policy END,
                          j.step, j.failed, j.n,
                          (SELECT string_agg(x, ', ') FROM (
                               SELECT jsonb_array_elements_text(failed_ids) AS x LIMIT 20) f)));
    UPDATE jobs SET status = 'dead_letter', waiting_reason = NULL, error = err,
                    errors = calmq_append_error(errors, err || jsonb_build_object('attempt', 0),
                                                100),
                    updated_at = now()
    WHERE id = j.parent_id AND status = 'queued' AND waiting_reason = 'children'
    RETURNING * INTO p;
    IF NOT FOUND THEN
        RETURN NULL;
    END IF;
    INSERT INTO job_events (job_id, type, attempt, detail)
    VALUES (p.id, 'dead_lettered', 0, err || jsonb_build_object(
        'policy', j.policy, 'children', j.n, 'succeeded', j.succeeded, 'failed', j.failed,
        'failed_children', failed_ids));
    PERFORM calmq_join_outbox(p.id, j.fail_outbox, jsonb_build_object(
        'job.result', jsonb_build_object('error', err),
        'job.dead_lettered', jsonb_build_object('errors', p.errors)));
    RETURN NULL;
END
$$;

-- Only children reaching a terminal status (from one that is not).
DROP TRIGGER IF EXISTS jobs_settle_child ON jobs;
CREATE TRIGGER jobs_settle_child AFTER UPDATE OF status ON jobs
    FOR EACH ROW
    WHEN (NEW.parent_id IS NOT NULL
          AND NEW.status IN ('completed', 'dead_letter', 'cancelled')
          AND OLD.status NOT IN ('completed', 'dead_letter', 'cancelled'))
    EXECUTE FUNCTION calmq_settle_child();

-- A parent cancelled takes its children that have not ended with it (they are cancelled,
-- with the history saying by whom), in the same statement as the parent's cancel; then its
-- join, if those cancels left it open, is closed. The join row is taken after the children
-- (as a finishing child takes its own row, then the join's), so a cancel and a child's
-- finish only deadlock when that finish decides the join just then (PostgreSQL then ends
-- one; either is retried). A cancel that decides the join finds the parent cancelled
-- already and moves nothing. A parent dead-lettered (its join failed) leaves its children
-- be: those still running finish and keep their outputs, and a redrive re-runs only the
-- failed ones (children_rearm).
CREATE OR REPLACE FUNCTION calmq_cascade_parent() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    WITH cancelled AS (
        UPDATE jobs SET status = 'cancelled', lease_owner = NULL, lease_expires_at = NULL,
                        waiting_until = NULL, updated_at = now()
        WHERE parent_id = NEW.id AND status NOT IN ('completed', 'dead_letter', 'cancelled')
        RETURNING id, attempt
    )
    INSERT INTO job_events (job_id, type, attempt, detail)
    SELECT id, 'cancelled', attempt,
           jsonb_build_object('by', 'parent', 'parent_id', NEW.id::text)
    FROM cancelled;
    UPDATE job_joins SET fired_at = now(), outcome = NEW.status
    WHERE parent_id = NEW.id AND fired_at IS NULL;
    RETURN NULL;
END
$$;

DROP TRIGGER IF EXISTS jobs_cascade_parent ON jobs;
CREATE TRIGGER jobs_cascade_parent AFTER UPDATE OF status ON jobs
    FOR EACH ROW
    WHEN (NEW.status = 'cancelled' AND OLD.status IS DISTINCT FROM NEW.status)
    EXECUTE FUNCTION calmq_cascade_parent();
