-- A streamed step's text (migration 0033): chunks as the model writes them, and the text
-- of a final job's streams compacted into one row per step.

-- name: output_append
-- One group of chunks (many jobs'), and their notifications: each payload is a JSON array
-- of one job's chunks that fits NOTIFY's 8,000 bytes (calmq.data.outputs). All in one
-- statement: the chunks and their announcements commit together.
-- Only a job not deleted takes chunks: a purge (retention_redact_job) locks the job's row
-- FOR UPDATE before it redacts it and deletes its text, so a group written meanwhile waits
-- for it and then finds the job redacted (none of its text is kept: a worker still
-- streaming after a cancel and a delete writes nothing), and a group written first commits
-- first and its chunks are in the purge's delete. FOR KEY SHARE, in id order: it does not
-- wait for a worker's updates of the row (heartbeats, outcomes), only for the purge.
-- A payload is sent only while some event stream follows its job (job_followers, migration
-- 0051): text nobody watches is written, not broadcast to every API process.
WITH live AS (
    SELECT id FROM jobs WHERE id = ANY(%(job_ids)s::uuid[]) AND redacted_at IS NULL
    ORDER BY id
    FOR KEY SHARE
), written AS (
    INSERT INTO job_output_chunks (job_id, stream, seq, step, attempt, "offset", text)
    SELECT c.* FROM unnest(%(job_ids)s::uuid[], %(streams)s::bigint[], %(seqs)s::int[],
                           %(steps)s::text[], %(attempts)s::int[], %(offsets)s::int[],
                           %(texts)s::text[])
                    AS c(job_id, stream, seq, step, attempt, "offset", text)
    WHERE c.job_id IN (SELECT id FROM live)
    ON CONFLICT (job_id, stream, seq) DO NOTHING
    RETURNING 1
)
SELECT (SELECT count(*) FROM written) AS written,
       (SELECT count(pg_notify('calmq_job_output', p.payload))
          FROM unnest(%(payloads)s::text[], %(payload_jobs)s::uuid[]) AS p(payload, job_id)
         WHERE p.job_id IN (SELECT id FROM live)
           AND EXISTS (SELECT 1 FROM job_followers f
                       WHERE f.job_id = p.job_id AND f.expires_at > now())) AS notified;

-- name: output_follow
-- An event stream follows the job (or still does: the expiry moves on), until output_unfollow
-- or the expiry; its process refreshes it while the stream lasts.
INSERT INTO job_followers (job_id, follower, expires_at)
VALUES (%(id)s, %(follower)s, now() + make_interval(secs => %(ttl_seconds)s))
ON CONFLICT (job_id, follower) DO UPDATE SET expires_at = EXCLUDED.expires_at;

-- name: output_unfollow
DELETE FROM job_followers WHERE job_id = %(id)s AND follower = %(follower)s;

-- name: output_followers_prune
-- The rows of streams whose process died without deleting them (the compaction pass's).
DELETE FROM job_followers WHERE expires_at < now();

-- name: output_after
-- What a reader after (stream, seq) needs, in one snapshot: every stream of the job
-- (kind 'stream': its step, attempt, last seq and whether it is its step's latest), the
-- chunks after the position, and the compacted text of each step (kind 'compacted').
WITH chunks AS (
    SELECT stream, seq, step, attempt, "offset", text
      FROM job_output_chunks WHERE job_id = %(id)s
), streams AS (
    SELECT stream, step, min(attempt) AS attempt, max(seq) AS seq FROM chunks
     GROUP BY stream, step
)
SELECT 'stream' AS kind, s.stream, s.seq, s.step, s.attempt, 0 AS "offset",
       NULL::text AS text, s.stream = max(s.stream) OVER (PARTITION BY s.step) AS current
  FROM streams s
UNION ALL
SELECT 'chunk', c.stream, c.seq, c.step, c.attempt, c."offset", c.text, NULL
  FROM chunks c WHERE (c.stream, c.seq) > (%(stream)s, %(seq)s)
UNION ALL
SELECT 'compacted', o.stream, o.chunks, o.step, o.attempt, 0, o.text, TRUE
  FROM job_outputs o WHERE o.job_id = %(id)s
ORDER BY 2, 3, 1;

-- name: output_compact
-- The chunks of final jobs (at most %(limit)s jobs a pass): each step's last stream
-- becomes its job_outputs row, every chunk is deleted. Concurrent passes are safe: a
-- chunk is deleted once, and a later stream of a step (a redriven job) replaces the row.
-- A deleted (redacted) job's chunks are deleted and not compacted: its text is gone.
WITH done AS (
    SELECT DISTINCT c.job_id, j.redacted_at IS NOT NULL AS deleted
      FROM job_output_chunks c JOIN jobs j ON j.id = c.job_id
     WHERE j.status IN ('completed', 'dead_letter', 'cancelled')
     LIMIT %(limit)s
), gone AS (
    DELETE FROM job_output_chunks c USING done d WHERE c.job_id = d.job_id
    RETURNING c.job_id, c.stream, c.seq, c.step, c.attempt, c.text, d.deleted
), kept AS (
    SELECT job_id, step, max(stream) AS stream FROM gone WHERE NOT deleted
     GROUP BY job_id, step
), compacted AS (
    INSERT INTO job_outputs (job_id, step, stream, attempt, chunks, text)
    SELECT g.job_id, g.step, g.stream, min(g.attempt), max(g.seq),
           string_agg(g.text, '' ORDER BY g.seq)
      FROM gone g JOIN kept k ON (k.job_id, k.step, k.stream) = (g.job_id, g.step, g.stream)
     GROUP BY g.job_id, g.step, g.stream
    ON CONFLICT (job_id, step) DO UPDATE
       SET stream = EXCLUDED.stream, attempt = EXCLUDED.attempt, chunks = EXCLUDED.chunks,
           text = EXCLUDED.text, compacted_at = now()
     WHERE job_outputs.stream < EXCLUDED.stream
    RETURNING job_id
)
SELECT (SELECT count(DISTINCT job_id) FROM gone) AS jobs,
       (SELECT count(*) FROM gone) AS chunks;

-- name: output_text
-- A job's compacted text per step (the console's job page; a final job's streams).
SELECT step, stream, attempt, chunks, text FROM job_outputs WHERE job_id = %(id)s
 ORDER BY stream;
