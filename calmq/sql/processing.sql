-- Named queries of the processing engine (processors/), loaded with every other *.sql file.

-- name: processing_release_leases
-- A worker that stops before its in-flight attempts finished hands their leases back:
-- the lease expires now, so the message's redelivery (or the reaper) takes the job at once
-- and the history reads requeued_after_restart, running.
UPDATE jobs SET lease_expires_at = now(), updated_at = now()
WHERE id = ANY(%(ids)s) AND lease_owner = %(worker)s AND status = 'running'
RETURNING id;
