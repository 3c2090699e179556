-- Partitioned history (issue 32), step 2 of 4 (0029 says the whole plan): prove that every
-- row of job_events and job_attempts lies before the cutover. VALIDATE scans each table but
-- holds only SHARE UPDATE EXCLUSIVE, which every INSERT, UPDATE, DELETE and SELECT goes past
-- (it waits only for DDL and VACUUM of the same table); it took 2 s for the history of
-- 500,000 jobs on a loaded machine, so about 80 s for 20 M (BENCHMARKS.md, "Month six").
ALTER TABLE job_events VALIDATE CONSTRAINT job_events_before_partitions;
ALTER TABLE job_attempts VALIDATE CONSTRAINT job_attempts_before_partitions;
