-- What the provider keeps of a batch (issue 27): the input file calmq uploaded and the
-- output and error files (OpenAI), or the batch and its results (Anthropic), stayed with
-- the provider after calmq collected the batch, after its jobs were deleted, for as long
-- as the provider keeps them (Anthropic: results for 29 days; OpenAI: until deleted). The
-- poller now deletes them once a batch is collected, and records it here; a batch whose
-- files are not deleted yet (the provider was away, or it was collected before this) is
-- taken again by a poller until they are.
ALTER TABLE provider_batches ADD COLUMN files_deleted_at timestamptz;
CREATE INDEX provider_batches_files ON provider_batches (next_poll_at)
    WHERE files_deleted_at IS NULL AND provider_id IS NOT NULL
      AND state IN ('collected', 'abandoned');
