-- Partitioned history (issue 32), step 4 of 4 (0029 says the whole plan): the swap.
--
-- One transaction, under ACCESS EXCLUSIVE on both tables for as long as it takes to change
-- the catalog (0.4 s in all at 500,000 jobs: BENCHMARKS.md, "Month six"): nothing is copied
-- or scanned. lock_timeout makes it give up rather than queue every reader and writer behind
-- a long transaction; the migrator tries again.
--
-- Statements written before this migration (and the previous release, still serving while
-- it runs) keep working unchanged: the partitioned tables have the old names, columns and
-- defaults, the history trigger moves to the new job_events, and event ids keep counting up
-- from the same place (a sequence of the new table, set past the old one's last value).
SET LOCAL lock_timeout = '5s';
LOCK TABLE job_events, job_attempts IN ACCESS EXCLUSIVE MODE;

DO $$
DECLARE
    events_cutover    timestamptz;
    attempts_cutover  timestamptz;
    last_event        bigint;
BEGIN
    SELECT (regexp_match(pg_get_constraintdef(oid), '''([^'']+)'''))[1]::timestamptz
    INTO events_cutover FROM pg_constraint WHERE conname = 'job_events_before_partitions';
    SELECT (regexp_match(pg_get_constraintdef(oid), '''([^'']+)'''))[1]::timestamptz
    INTO attempts_cutover FROM pg_constraint WHERE conname = 'job_attempts_before_partitions';

    -- job_events: the old table becomes job_events_legacy, its identity a plain sequence of
    -- the new table (identity columns cannot be attached as a partition's).
    ALTER TABLE job_events RENAME TO job_events_legacy;
    ALTER INDEX job_events_job RENAME TO job_events_legacy_job;
    ALTER INDEX job_events_pkey RENAME TO job_events_legacy_pkey;
    ALTER INDEX job_events_at RENAME TO job_events_legacy_at;
    SELECT last_value INTO last_event FROM job_events_id_seq;
    CREATE SEQUENCE job_events_seq AS bigint;
    PERFORM setval('job_events_seq', greatest(last_event, 1));
    ALTER TABLE job_events_legacy ALTER COLUMN id DROP IDENTITY;
    DROP TRIGGER job_events_notify ON job_events_legacy;
    CREATE TABLE job_events (
        id        bigint NOT NULL DEFAULT nextval('job_events_seq'),
        job_id    uuid NOT NULL,
        type      text NOT NULL,
        at        timestamptz NOT NULL DEFAULT clock_timestamp(),
        attempt   integer NOT NULL,
        detail    jsonb NOT NULL DEFAULT '{}'
    ) PARTITION BY RANGE (at);
    ALTER SEQUENCE job_events_seq OWNED BY job_events.id;
    -- No primary key: a unique index of a partitioned table must hold the partition key, and
    -- nothing looks an event up by its id alone (a job's history is read by job_id, in id
    -- order). One index entry per event instead of two.
    CREATE INDEX job_events_job ON ONLY job_events (job_id, id);
    CREATE INDEX job_events_at ON ONLY job_events USING brin (at);
    EXECUTE format('ALTER TABLE job_events ATTACH PARTITION job_events_legacy'
                   ' FOR VALUES FROM (MINVALUE) TO (%L)', events_cutover);
    ALTER INDEX job_events_job ATTACH PARTITION job_events_legacy_job;
    ALTER INDEX job_events_at ATTACH PARTITION job_events_legacy_at;
    CREATE TRIGGER job_events_notify AFTER INSERT ON job_events
        REFERENCING NEW TABLE AS new_events
        FOR EACH STATEMENT EXECUTE FUNCTION calmq_job_events_notify();

    -- job_attempts: same columns, partitioned by started_at; its old primary key stays on
    -- job_attempts_legacy.
    ALTER TABLE job_attempts RENAME TO job_attempts_legacy;
    ALTER INDEX job_attempts_pkey RENAME TO job_attempts_legacy_pkey;
    ALTER INDEX job_attempts_started RENAME TO job_attempts_legacy_started;
    ALTER INDEX job_attempts_by_job RENAME TO job_attempts_legacy_job;
    CREATE TABLE job_attempts (LIKE job_attempts_legacy INCLUDING DEFAULTS)
        PARTITION BY RANGE (started_at);
    CREATE INDEX job_attempts_job ON ONLY job_attempts (job_id, step, attempt);
    CREATE INDEX job_attempts_started ON ONLY job_attempts (started_at);
    EXECUTE format('ALTER TABLE job_attempts ATTACH PARTITION job_attempts_legacy'
                   ' FOR VALUES FROM (MINVALUE) TO (%L)', attempts_cutover);
    ALTER INDEX job_attempts_job ATTACH PARTITION job_attempts_legacy_job;
    ALTER INDEX job_attempts_started ATTACH PARTITION job_attempts_legacy_started;
END $$;

-- Make the partitions of job_events and job_attempts that end within p_ahead of now, each
-- p_width wide, after the newest one there is; returns how many were made. Run by the
-- housekeeping (calmq/data/partitions.py) every few minutes, so that an insert always finds
-- its partition: there is no default partition (one would forbid DETACH ... CONCURRENTLY, and
-- a row in it would block every partition made after). One caller at a time (a lock); the
-- caller sets a lock_timeout, so that a long transaction on the history makes a pass give up
-- (the next one makes the partition) rather than wait with the whole fleet behind it.
-- Partition names carry their lower bound in UTC: job_events_20261207_0000.
-- job_attempts partitions keep a fifth of each page free: a finish rewrites its attempt row
-- (outcome, error, tokens: no indexed column), which stays a HOT update when the page has room.
CREATE FUNCTION calmq_history_partitions(p_ahead interval, p_width interval)
RETURNS integer LANGUAGE plpgsql AS $$
DECLARE
    parent  text;
    name    text;
    hi      timestamptz;
    made    integer := 0;
BEGIN
    IF p_width < interval '1 minute' THEN
        RAISE EXCEPTION 'a history partition is at least a minute wide, not %', p_width;
    END IF;
    PERFORM pg_advisory_xact_lock(hashtextextended('calmq.history_partitions', 0));
    FOREACH parent IN ARRAY ARRAY['job_events', 'job_attempts'] LOOP
        SELECT max((regexp_match(pg_get_expr(c.relpartbound, c.oid),
                                 'TO \(''([^'']+)''\)'))[1]::timestamptz)
        INTO hi
        FROM pg_inherits i JOIN pg_class c ON c.oid = i.inhrelid
        WHERE i.inhparent = parent::regclass;
        WHILE hi < now() + p_ahead LOOP
            name := parent || '_' || to_char(hi AT TIME ZONE 'UTC', 'YYYYMMDD"_"HH24MI');
            -- Made apart, then attached: CREATE TABLE ... PARTITION OF would take ACCESS
            -- EXCLUSIVE on the parent (every reader and writer of the history waits), ATTACH
            -- takes SHARE UPDATE EXCLUSIVE, which they go past. The partition's indexes are
            -- made by ATTACH from the parent's (on an empty table: at once).
            EXECUTE format('CREATE TABLE %I (LIKE %I INCLUDING DEFAULTS) %s', name, parent,
                           CASE WHEN parent = 'job_attempts'
                                THEN 'WITH (fillfactor = 80)' ELSE '' END);
            EXECUTE format('ALTER TABLE %I ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                           parent, name, hi, hi + p_width);
            hi := hi + p_width;
            made := made + 1;
        END LOOP;
    END LOOP;
    RETURN made;
END $$;

SELECT calmq_history_partitions(interval '3 days', interval '1 day');
