-- The baseline a team would build instead of calmq: one table, workers claim one row per
-- transaction with FOR UPDATE SKIP LOCKED. No history, no outbox, no Kafka.

-- name: schema
CREATE TABLE IF NOT EXISTS bench_queue (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    run         text NOT NULL,
    input       jsonb NOT NULL,
    status      text NOT NULL DEFAULT 'queued',
    attempts    integer NOT NULL DEFAULT 0,
    result      jsonb,
    created_at  timestamptz NOT NULL DEFAULT clock_timestamp(),
    claimed_at  timestamptz,
    done_at     timestamptz
);
CREATE INDEX IF NOT EXISTS bench_queue_queued ON bench_queue (id) WHERE status = 'queued';

-- name: insert
INSERT INTO bench_queue (run, input) VALUES (%(run)s, %(input)s) RETURNING id;

-- name: claim
UPDATE bench_queue SET status = 'running', attempts = attempts + 1,
                       claimed_at = clock_timestamp()
WHERE id = (SELECT id FROM bench_queue WHERE status = 'queued'
            ORDER BY id FOR UPDATE SKIP LOCKED LIMIT 1)
RETURNING id, input;

-- name: complete
UPDATE bench_queue SET status = 'completed', result = %(result)s, done_at = clock_timestamp()
WHERE id = %(id)s;

-- name: fail
UPDATE bench_queue SET status = 'queued' WHERE id = %(id)s;

-- name: summary
SELECT count(*) FILTER (WHERE status = 'completed'),
       extract(epoch FROM min(claimed_at)),
       extract(epoch FROM max(done_at))
FROM bench_queue WHERE id > %(after)s;

-- name: last_id
SELECT coalesce(max(id), 0) FROM bench_queue;
