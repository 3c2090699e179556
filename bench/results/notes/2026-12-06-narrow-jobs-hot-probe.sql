-- A narrow "hot" table with the columns a claim and a finish change, and every index of
-- jobs that must stay with them (their keys or predicates read those columns).
CREATE TABLE jobs_hot (
    id uuid PRIMARY KEY, tenant_id uuid NOT NULL, pool text NOT NULL, priority text NOT NULL,
    status text NOT NULL, attempt integer NOT NULL DEFAULT 0, lease_version bigint NOT NULL DEFAULT 0,
    lease_owner text, lease_expires_at timestamptz, waiting_reason text,
    created_at timestamptz NOT NULL DEFAULT now(), updated_at timestamptz NOT NULL DEFAULT now(),
    redacted_at timestamptz) WITH (fillfactor = 90);
CREATE INDEX ON jobs_hot (pool, priority, updated_at) WHERE status IN ('queued', 'retrying');
CREATE INDEX ON jobs_hot (pool, priority) WHERE status = 'running';
CREATE INDEX ON jobs_hot (created_at) WHERE redacted_at IS NULL AND status IN ('completed', 'dead_letter', 'cancelled');
CREATE INDEX ON jobs_hot (updated_at, id) WHERE status = 'dead_letter';
CREATE INDEX ON jobs_hot (tenant_id, created_at) WHERE waiting_reason IS NOT NULL;
INSERT INTO jobs_hot (id, tenant_id, pool, priority, status)
SELECT gen_random_uuid(), '5ca1e000-0000-4000-8000-000000000001', 'default', 'bulk', 'queued'
FROM generate_series(1, 20000);
SELECT pg_stat_force_next_flush();
-- the claim's SET list, in groups of 20 ids
DO $$
DECLARE ids uuid[];
BEGIN
  FOR ids IN SELECT array_agg(id) FROM (SELECT id, (row_number() OVER ()) / 20 AS g FROM jobs_hot) s GROUP BY g LOOP
    UPDATE jobs_hot SET status = 'running', attempt = attempt + 1, lease_version = lease_version + 1,
           lease_owner = 'w', waiting_reason = NULL, lease_expires_at = now() + interval '60 s',
           updated_at = now() WHERE id = ANY(ids);
  END LOOP;
END $$;
-- a heartbeat: the lease alone
UPDATE jobs_hot SET lease_expires_at = now() + interval '90 s';
-- the finish
UPDATE jobs_hot SET status = 'completed', lease_owner = NULL, lease_expires_at = NULL, updated_at = now();
SELECT pg_stat_force_next_flush();
SELECT n_tup_upd, n_tup_hot_upd, round(n_tup_hot_upd::numeric / n_tup_upd, 3) AS hot_share
FROM pg_stat_user_tables WHERE relname = 'jobs_hot';
