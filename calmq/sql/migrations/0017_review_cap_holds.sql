-- Review caps enforced (issue 18): a queued job of a workflow that can end in review waits
-- while its pool's pending reviews are at the pool's cap (review_caps, 0013). held_at: since
-- when it waits for the cap (NULL: not held); released_at: when the release pass let it go,
-- so the pass counts the jobs it released that are not in review yet against the cap.
-- Columns of their own (not a shared "waiting reason"), so other waits merge beside them.
ALTER TABLE jobs ADD COLUMN review_cap_held_at timestamptz;
ALTER TABLE jobs ADD COLUMN review_cap_released_at timestamptz;
CREATE INDEX jobs_review_cap_held ON jobs (pool, review_cap_held_at)
    WHERE review_cap_held_at IS NOT NULL;
