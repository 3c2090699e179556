-- The join's cost per child (issue 43, `calmq bench fanout`): calmq_settle_child ran once per
-- child row a statement settled. A group commit settles up to a few hundred children of one
-- parent in one statement, so the one job_joins row was updated once per child: as many
-- new row versions, each found by walking the chain of the versions before it, and every
-- concurrent group commit of that parent's children queued on the row's lock meanwhile.
--
-- Now the trigger runs once per statement, over its transition tables: it counts the
-- children the statement settled per join and updates each join row once, deciding the
-- policy in the same UPDATE. Every guarantee of 0053 holds:
-- - the join row's lock still orders the transactions that settle children of one join, so
--   exactly one of them finds the policy decided and marks fired_at; the rows are locked in
--   (parent_id, step) order, so two statements settling children of the same parents
--   cannot deadlock on them;
-- - as many held children are released as the statement settled children of their parent,
--   the first ones in input order (SKIP LOCKED: two statements at once release different
--   ones), and their job.requested rows are written in that order;
-- - a child's cancel or dead letter counts as a failure, whichever statement settles it
--   (a cancel's cascade, a purge, the reaper's poison), and a nested statement (a join
--   failing a parent that is itself a child) is settled by its own firing.
-- What differs: children settled in the statement that decides the join are all counted
-- (0053 stopped counting at the child that decided it), so children_joined reports what
-- had ended by then.
--
-- Transition tables cannot name columns (AFTER UPDATE OF status), so every UPDATE of jobs
-- keeps its old and new rows for the statement: a copy of each row in memory, which the
-- trigger's first test reads once (under a microsecond per row of a 250-row update, whose
-- own work is some 25 µs per row; bench fanout's independent jobs pay it too). On the same
-- 250 children of one parent, the trigger's time went from 15-26 ms (250 calls) to 1-3 ms
-- (one call).
SET LOCAL lock_timeout = '5s';

-- The policy's verdict on a join's counts: NULL while it is undecided. For at_least, k
-- successes win over the failures that arrive in the same statement.
CREATE OR REPLACE FUNCTION calmq_join_verdict(policy text, k integer, n integer,
                                              succeeded integer, failed integer)
RETURNS text LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN policy = 'all' AND failed > 0 THEN 'failed'
        WHEN policy = 'all' AND succeeded >= n THEN 'resumed'
        WHEN policy = 'at_least' AND succeeded >= k THEN 'resumed'
        WHEN policy = 'at_least' AND n - failed < k THEN 'failed'
        WHEN policy = 'all_finish' AND succeeded + failed >= n THEN 'resumed'
    END
$$;

DROP TRIGGER IF EXISTS jobs_settle_child ON jobs;

CREATE OR REPLACE FUNCTION calmq_settle_child() RETURNS trigger LANGUAGE plpgsql AS $$
DECLARE
    parents uuid[];
    steps text[];
    oks integer[];
    bads integer[];
    j job_joins%ROWTYPE;
    failed_ids jsonb;
    err jsonb;
    p jobs%ROWTYPE;
BEGIN
    -- Most UPDATEs of jobs settle no child: one pass over the new rows says so.
    IF NOT EXISTS (SELECT 1 FROM settled_new n
                   WHERE n.parent_id IS NOT NULL
                     AND n.status IN ('completed', 'dead_letter', 'cancelled')) THEN
        RETURN NULL;
    END IF;
    -- The children this statement moved to a terminal status (from one that is not), per
    -- join, in the order their rows are locked.
    SELECT array_agg(s.parent_id ORDER BY s.parent_id, s.step),
           array_agg(s.step ORDER BY s.parent_id, s.step),
           array_agg(s.ok ORDER BY s.parent_id, s.step),
           array_agg(s.bad ORDER BY s.parent_id, s.step)
    INTO parents, steps, oks, bads
    FROM (SELECT n.parent_id, n.parent_step AS step,
                 (count(*) FILTER (WHERE n.status = 'completed'))::integer AS ok,
                 (count(*) FILTER (WHERE n.status <> 'completed'))::integer AS bad
          FROM settled_new n JOIN settled_old o ON o.id = n.id
          WHERE n.parent_id IS NOT NULL
            AND n.status IN ('completed', 'dead_letter', 'cancelled')
            AND o.status NOT IN ('completed', 'dead_letter', 'cancelled')
          GROUP BY n.parent_id, n.parent_step) s;
    IF parents IS NULL THEN
        RETURN NULL;
    END IF;

    -- Places in flight are free: as many held siblings go as children ended, the first in
    -- input order (SKIP LOCKED: two statements ending children at once release different
    -- ones). One cancelled while held is gone with its row. The rows are found by key
    -- (= ANY of an array): a join with the release's estimate (a tenth of a parameter's
    -- LIMIT) planned a sequential scan of jobs, 70 ms a statement at 200,000 jobs.
    WITH freeing AS (
        SELECT u.p, sum(u.ok + u.bad)::integer AS m
        FROM unnest(parents, oks, bads) AS u(p, ok, bad) GROUP BY u.p
    ), next AS (
        DELETE FROM job_held_children h
        WHERE h.job_id = ANY (ARRAY(SELECT x.job_id FROM freeing f, LATERAL (
                                        SELECT n.job_id FROM job_held_children n
                                        WHERE n.parent_id = f.p
                                        ORDER BY n.child_index LIMIT f.m
                                        FOR UPDATE SKIP LOCKED) x))
        RETURNING h.*
    ), freed AS (
        UPDATE jobs c SET waiting_reason = NULL
        WHERE c.id = ANY (ARRAY(SELECT job_id FROM next)) AND c.status = 'queued'
        RETURNING c.id, c.created_at
    )
    INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers)
    SELECT g.id, n.route, f.id::text, 'job.requested',
           n.payload || jsonb_build_object(
               'event_id', g.id::text,
               'created_at', floor(extract(epoch FROM f.created_at) * 1000)::bigint),
           n.headers
    FROM next n JOIN freed f ON f.id = n.job_id, LATERAL (SELECT gen_random_uuid() AS id) g
    ORDER BY n.parent_id, n.child_index;

    -- Each join row once: locked in (parent_id, step) order first, then counted and
    -- decided in one UPDATE.
    PERFORM 1 FROM job_joins jj
    JOIN unnest(parents, steps) AS u(p, s) ON jj.parent_id = u.p AND jj.step = u.s
    WHERE jj.fired_at IS NULL
    ORDER BY jj.parent_id, jj.step
    FOR UPDATE OF jj;

    FOR j IN
        WITH counted AS (
            UPDATE job_joins jj
            SET succeeded = jj.succeeded + u.ok, failed = jj.failed + u.bad,
                outcome = calmq_join_verdict(jj.policy, jj.k, jj.n, jj.succeeded + u.ok,
                                             jj.failed + u.bad),
                fired_at = CASE WHEN calmq_join_verdict(jj.policy, jj.k, jj.n,
                                                        jj.succeeded + u.ok,
                                                        jj.failed + u.bad) IS NOT NULL
                                THEN now() END
            FROM unnest(parents, steps, oks, bads) AS u(p, s, ok, bad)
            WHERE jj.parent_id = u.p AND jj.step = u.s AND jj.fired_at IS NULL
            RETURNING jj.*
        )
        SELECT * FROM counted WHERE outcome IS NOT NULL ORDER BY parent_id, step
    LOOP
        -- Named in the parent's history and error: the first thousand, in input order.
        SELECT COALESCE(jsonb_agg(c.id::text ORDER BY c.child_index), '[]'::jsonb)
        INTO failed_ids
        FROM (SELECT id, child_index FROM jobs
              WHERE parent_id = j.parent_id AND parent_step = j.step
                AND status IN ('dead_letter', 'cancelled')
              ORDER BY child_index LIMIT 1000) c;
        IF j.outcome = 'resumed' THEN
            UPDATE jobs SET waiting_reason = NULL, updated_at = now()
            WHERE id = j.parent_id AND status = 'queued' AND waiting_reason = 'children'
            RETURNING * INTO p;
            IF NOT FOUND THEN  -- cancelled or purged meanwhile: nothing to resume
                CONTINUE;
            END IF;
            INSERT INTO job_events (job_id, type, attempt, detail)
            VALUES (p.id, 'children_joined', 0, jsonb_build_object(
                'step', j.step, 'policy', j.policy, 'children', j.n,
                'succeeded', j.succeeded, 'failed', j.failed, 'failed_children', failed_ids));
            PERFORM calmq_join_outbox(p.id, j.resume_outbox, '{}'::jsonb);
            CONTINUE;
        END IF;
        err := jsonb_build_object(
            'code', 'children_failed', 'class', 'input',
            'message', format('the join (%s) of step %s can no longer hold: %s of %s children '
                              'failed (%s)', CASE WHEN j.policy = 'at_least'
                                                  THEN format('at least %s', j.k)
                                                  ELSE j.policy END,
                              j.step, j.failed, j.n,
                              (SELECT string_agg(x, ', ') FROM (
                                   SELECT jsonb_array_elements_text(failed_ids) AS x
                                   LIMIT 20) f)));
        UPDATE jobs SET status = 'dead_letter', waiting_reason = NULL, error = err,
                        errors = calmq_append_error(errors,
                                                    err || jsonb_build_object('attempt', 0),
                                                    100),
                        updated_at = now()
        WHERE id = j.parent_id AND status = 'queued' AND waiting_reason = 'children'
        RETURNING * INTO p;
        IF NOT FOUND THEN
            CONTINUE;
        END IF;
        INSERT INTO job_events (job_id, type, attempt, detail)
        VALUES (p.id, 'dead_lettered', 0, err || jsonb_build_object(
            'policy', j.policy, 'children', j.n, 'succeeded', j.succeeded,
            'failed', j.failed, 'failed_children', failed_ids));
        PERFORM calmq_join_outbox(p.id, j.fail_outbox, jsonb_build_object(
            'job.result', jsonb_build_object('error', err),
            'job.dead_lettered', jsonb_build_object('errors', p.errors)));
    END LOOP;
    RETURN NULL;
END
$$;

CREATE TRIGGER jobs_settle_child AFTER UPDATE ON jobs
    REFERENCING OLD TABLE AS settled_old NEW TABLE AS settled_new
    FOR EACH STATEMENT
    EXECUTE FUNCTION calmq_settle_child();
