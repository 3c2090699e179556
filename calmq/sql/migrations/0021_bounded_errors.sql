-- A job's errors list kept to its last N entries (setting max_job_errors, issue 27).
--
-- Every failed attempt, review rejection and poison verdict appended to jobs.errors, and a
-- review-reject / redrive cycle can repeat without end: the list grew without bound, and
-- job.dead_lettered carries all of it, so one tenant could grow an event past what Kafka
-- takes. Each statement that appends now appends through this function with the limit as
-- a parameter; older entries drop off (the attempts table keeps every attempt's error).
CREATE OR REPLACE FUNCTION calmq_append_error(errors jsonb, error jsonb, keep integer)
RETURNS jsonb LANGUAGE sql IMMUTABLE PARALLEL SAFE AS $$
    SELECT CASE
        WHEN jsonb_array_length(all_errors) <= keep THEN all_errors
        ELSE (SELECT COALESCE(jsonb_agg(e ORDER BY n), '[]'::jsonb)
              FROM jsonb_array_elements(all_errors) WITH ORDINALITY AS t(e, n)
              WHERE n > jsonb_array_length(all_errors) - keep)
    END
    FROM (SELECT COALESCE(errors, '[]'::jsonb) || jsonb_build_array(error) AS all_errors) a
$$;
