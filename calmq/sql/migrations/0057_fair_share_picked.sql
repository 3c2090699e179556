-- calmq: no-transaction
-- A job a worker picked out of a waiting room is on its way to that worker's claim
-- (waiting_reason fair_share_picked, no lease, no message). A worker killed between its pick
-- and its claim left such jobs queued with nothing to carry them until the sweeper's grace
-- (10 minutes); the reaper now returns them to their room after a lease (calmq/sql/
-- fairness.sql fair_share_return_picked), and looks for them every few seconds. Few rows:
-- only the jobs between a pick and a claim.
-- Built CONCURRENTLY (hence the first line): jobs may hold months of rows.
CREATE INDEX CONCURRENTLY IF NOT EXISTS jobs_fair_picked ON jobs (updated_at)
    WHERE waiting_reason = 'fair_share_picked' AND status IN ('queued', 'retrying');
