-- Deleting tenant data (calmq/data/retention.py): redaction of a terminal job, and what is
-- past its retention.

-- name: retention_redact_job
-- Keep the row, its status and its history's shape; drop every piece of tenant data.
-- The row is locked FOR UPDATE first: a worker's group of streamed chunks for the job
-- (output_append, FOR KEY SHARE) waits until the purge commits and then writes none, so no
-- text written after the delete survives it (retention_delete_outputs runs in this
-- transaction).
WITH locked AS (
    SELECT id FROM jobs WHERE id = %(id)s AND tenant_id = %(tenant_id)s FOR UPDATE
)
UPDATE jobs SET input = NULL, input_ref = NULL, metadata = '{}', callback_url = NULL,
                artifact = NULL,
                error = CASE WHEN error IS NULL THEN NULL
                             ELSE jsonb_build_object('code', error->'code', 'class',
                                                     error->'class', 'message', 'redacted') END,
                errors = '[]',
                -- a repeat (a purge that died half way, or an older, narrower redaction)
                -- finishes the work without moving the job's times
                updated_at = CASE WHEN redacted_at IS NULL THEN now() ELSE updated_at END,
                redacted_at = COALESCE(redacted_at, now())
WHERE id = (SELECT id FROM locked)
  AND status IN ('completed', 'dead_letter', 'cancelled')
RETURNING id;

-- What a purge reads before it redacts: the JSON that may name the job's objects (the
-- artifact, every step's output) and the steps that may have written an artifact.
-- name: retention_job_documents
SELECT s.step, s.output, s.model_output FROM step_outputs s
JOIN jobs j ON j.id = s.job_id
WHERE s.job_id = %(id)s AND j.tenant_id = %(tenant_id)s;

-- name: retention_job_attempt_versions
-- Each attempt's step and fencing token, of this round and of earlier (redriven) ones: an
-- attempt's artifact is keyed by them, also a stale attempt's that no row points at.
SELECT a.step, a.lease_version FROM job_attempts a
JOIN jobs j ON j.id = a.job_id
WHERE a.job_id = %(id)s AND j.tenant_id = %(tenant_id)s AND a.lease_version IS NOT NULL
  AND a.started_at >= (SELECT k.created_at FROM jobs k WHERE k.id = %(id)s)
UNION
SELECT r.step, (r.record ->> 'lease_version')::bigint FROM job_attempts_redriven r
JOIN jobs j ON j.id = r.job_id
WHERE r.job_id = %(id)s AND j.tenant_id = %(tenant_id)s
  AND r.record ->> 'lease_version' IS NOT NULL;

-- The statements below run in the transaction of retention_redact_job, after it redacted
-- the row (so only for the tenant's terminal job); every table with a job or tenant column
-- is in calmq.data.retention.COVERAGE, and tests/integration/test_deletion_coverage.py
-- fails when one is not.

-- name: retention_redact_events
UPDATE job_events SET detail = '{}' WHERE job_id = %(id)s AND at >= (SELECT k.created_at FROM jobs k WHERE k.id = %(id)s);

-- name: retention_redact_attempts
-- The error message may quote the input or the model's answer; code and class are calmq's.
UPDATE job_attempts SET error_message = NULL
WHERE job_id = %(id)s AND started_at >= (SELECT k.created_at FROM jobs k WHERE k.id = %(id)s)
  AND error_message IS NOT NULL;

-- name: retention_redact_redriven
UPDATE job_attempts_redriven SET record = record || '{"error_message": null}'
WHERE job_id = %(id)s AND record->>'error_message' IS NOT NULL;

-- name: retention_redact_step_outputs
-- The model's output and a reviewer's corrections; state, confidence, the reviewer (the
-- calling key's identity) and the times stay.
UPDATE step_outputs SET output = '{}', model_output = NULL WHERE job_id = %(id)s;

-- name: retention_redact_side_effects
UPDATE side_effects SET response = NULL WHERE job_id = %(id)s AND response IS NOT NULL;

-- name: retention_redact_webhook_attempts
-- An error text may name the receiver or quote its answer.
UPDATE webhook_attempts SET error = NULL
WHERE error IS NOT NULL
  AND delivery_id IN (SELECT id FROM webhook_deliveries WHERE job_id = %(id)s);

-- name: retention_redact_webhooks
-- No URL left to deliver to: a delivery still pending ends as failed.
UPDATE webhook_deliveries
SET url = '', status = CASE WHEN status = 'pending' THEN 'failed' ELSE status END,
    finished_at = COALESCE(finished_at, now())
WHERE job_id = %(id)s;

-- name: retention_delete_idempotency_keys
-- The key is the tenant's own text and its hash covers the body: both go. A submit that
-- repeats the key afterwards is a new job.
DELETE FROM idempotency_keys WHERE job_id = %(id)s;

-- name: retention_delete_outputs
-- A streamed step's text, as chunks and compacted (migration 0033): the job's output.
WITH chunks AS (DELETE FROM job_output_chunks WHERE job_id = %(id)s)
DELETE FROM job_outputs WHERE job_id = %(id)s;

-- name: retention_delete_outbox
-- Events not yet published carry the input (job.requested) or errors; a terminal job whose
-- data is deleted has nothing left to announce. Published rows are pruned by the relay.
DELETE FROM outbox WHERE aggregateid = %(id)s::text;

-- name: retention_expired_jobs
-- Terminal jobs past retention (ended more than %(retention_seconds)s ago) that still hold
-- data, oldest created first, with what a purge of each reads before it deletes objects.
-- jobs_unredacted (created_at) walks them: a job is never older by updated_at than by
-- created_at, so the walk stops at the retention ago; the few it passes over (created long
-- ago, ended lately) stay for a later pass. Its first entry is also where the history's
-- retention horizon stands (partitions.sql, history_horizon).
SELECT id, tenant_id, status, input_ref, artifact, redacted_at, created_at, updated_at
FROM jobs
WHERE redacted_at IS NULL AND status IN ('completed', 'dead_letter', 'cancelled')
  AND created_at < now() - make_interval(secs => %(retention_seconds)s)
  AND updated_at < now() - make_interval(secs => %(retention_seconds)s)
ORDER BY created_at
LIMIT %(limit)s;

-- name: retention_jobs_documents
-- retention_job_documents for a batch of jobs the sweep chose (no tenant check: the sweep
-- read them from jobs itself).
SELECT job_id, step, output, model_output FROM step_outputs
WHERE job_id = ANY(%(ids)s::uuid[]);

-- name: retention_jobs_attempt_versions
-- retention_job_attempt_versions for a batch: every attempt of a job started between its
-- creation and its end, so the partitions read are those of the batch's lifetimes.
SELECT a.job_id, a.step, a.lease_version FROM job_attempts a
WHERE a.job_id = ANY(%(ids)s::uuid[]) AND a.lease_version IS NOT NULL
  AND a.started_at >= %(since)s AND a.started_at <= %(until)s
UNION
SELECT r.job_id, r.step, (r.record ->> 'lease_version')::bigint FROM job_attempts_redriven r
WHERE r.job_id = ANY(%(ids)s::uuid[]) AND r.record ->> 'lease_version' IS NOT NULL;

-- The retention sweep's redaction of a batch, in one transaction: the statements above for
-- one job, for many at once (one plan and one pass over each table per batch, not per job).
-- job_events and job_attempts are not touched: their time partitions go whole once every
-- job in them is past retention (calmq.data.partitions). A purge on request (DELETE
-- /v1/jobs/{id}, a tenant's deletion) redacts those rows at once, statement by statement.

-- name: retention_redact_jobs
UPDATE jobs SET input = NULL, input_ref = NULL, metadata = '{}', callback_url = NULL,
                artifact = NULL,
                error = CASE WHEN error IS NULL THEN NULL
                             ELSE jsonb_build_object('code', error->'code', 'class',
                                                     error->'class', 'message', 'redacted') END,
                errors = '[]',
                -- the job's times stay: its end is what retention counted from
                redacted_at = now()
WHERE id = ANY(%(ids)s::uuid[]) AND redacted_at IS NULL
  AND status IN ('completed', 'dead_letter', 'cancelled')
RETURNING id;

-- name: retention_redact_many_redriven
UPDATE job_attempts_redriven SET record = record || '{"error_message": null}'
WHERE job_id = ANY(%(ids)s::uuid[]) AND record->>'error_message' IS NOT NULL;

-- name: retention_redact_many_step_outputs
UPDATE step_outputs SET output = '{}', model_output = NULL WHERE job_id = ANY(%(ids)s::uuid[]);

-- name: retention_redact_many_side_effects
UPDATE side_effects SET response = NULL
WHERE job_id = ANY(%(ids)s::uuid[]) AND response IS NOT NULL;

-- name: retention_redact_many_webhook_attempts
UPDATE webhook_attempts SET error = NULL
WHERE error IS NOT NULL
  AND delivery_id IN (SELECT id FROM webhook_deliveries WHERE job_id = ANY(%(ids)s::uuid[]));

-- name: retention_redact_many_webhooks
UPDATE webhook_deliveries
SET url = '', status = CASE WHEN status = 'pending' THEN 'failed' ELSE status END,
    finished_at = COALESCE(finished_at, now())
WHERE job_id = ANY(%(ids)s::uuid[]);

-- name: retention_delete_many_idempotency_keys
DELETE FROM idempotency_keys WHERE job_id = ANY(%(ids)s::uuid[]);

-- name: retention_delete_many_outbox
-- One pass over the outbox (a queue: what the relay has not pruned yet) for the batch.
DELETE FROM outbox WHERE aggregateid = ANY(%(ids)s::text[]);

-- name: retention_redact_many_batch_jobs
UPDATE batch_jobs SET request = '{}'::jsonb
WHERE job_id = ANY(%(ids)s::uuid[]) AND request <> '{}'::jsonb;

-- name: retention_delete_many_outputs
-- retention_delete_outputs for the batch: streamed steps' chunks and compacted text.
WITH chunks AS (DELETE FROM job_output_chunks WHERE job_id = ANY(%(ids)s::uuid[]))
DELETE FROM job_outputs WHERE job_id = ANY(%(ids)s::uuid[]);

-- name: retention_many_batches_due
-- retention_batches_due for the batch: their provider batches looked at by a poller at once.
UPDATE provider_batches SET next_poll_at = now()
WHERE key IN (SELECT batch_key FROM batch_jobs WHERE job_id = ANY(%(ids)s::uuid[]))
  AND (state IN ('creating', 'submitted') OR files_deleted_at IS NULL);

-- name: retention_prune_idempotency_keys
DELETE FROM idempotency_keys
WHERE created_at < now() - make_interval(secs => %(retention_seconds)s);

-- name: retention_redact_batch_jobs
-- The request sent in a provider batch holds the job's input (the prompt).
UPDATE batch_jobs SET request = '{}'::jsonb WHERE job_id = %(id)s AND request <> '{}'::jsonb;

-- name: retention_batches_due
-- The provider batches that carried the job, looked at by a poller at once: an open one
-- none of whose jobs still waits is cancelled at the provider, and an ended one's files
-- (the job's request and answer among them) are deleted there.
UPDATE provider_batches SET next_poll_at = now()
WHERE key IN (SELECT batch_key FROM batch_jobs WHERE job_id = %(id)s)
  AND (state IN ('creating', 'submitted') OR files_deleted_at IS NULL);

-- A purge of a job with children (DELETE /v1/jobs/{id}, producers.retention): its
-- descendants, at every level, are purged a batch at a time with the statements of a
-- retention batch, plus the history rows a purge on request redacts at once; a parent is
-- never redacted before its descendants (deepest first, the job itself last).

-- name: retention_tree
-- Every descendant of the tenant's job (its children, theirs, ...), deepest first: a purge
-- that dies half way leaves no redacted job whose descendants are not, and a repeat finds
-- them all again (redacted ones too: the work is idempotent).
WITH RECURSIVE tree AS (
    SELECT id, 1 AS depth FROM jobs WHERE parent_id = %(id)s AND tenant_id = %(tenant_id)s
    UNION ALL
    SELECT j.id, t.depth + 1 FROM jobs j JOIN tree t ON j.parent_id = t.id
    WHERE j.tenant_id = %(tenant_id)s
)
SELECT id FROM tree ORDER BY depth DESC, id;

-- name: retention_jobs_by_id
-- A batch of the tenant's jobs as retention_expired_jobs reads them (a purge's batch of
-- descendants).
SELECT id, tenant_id, status, input_ref, artifact, redacted_at, created_at, updated_at
FROM jobs
WHERE id = ANY(%(ids)s::uuid[]) AND tenant_id = %(tenant_id)s;

-- name: retention_redact_tree_jobs
-- retention_redact_job for a batch of the tenant's terminal jobs, locked in id order (as
-- claim and finish_attempts lock jobs): a repeat redoes the work without moving the times.
-- Returns the ids redacted and the earliest creation among them (the history's bound).
WITH locked AS (
    SELECT id FROM jobs WHERE id = ANY(%(ids)s::uuid[]) AND tenant_id = %(tenant_id)s
    ORDER BY id
    FOR UPDATE
)
UPDATE jobs SET input = NULL, input_ref = NULL, metadata = '{}', callback_url = NULL,
                artifact = NULL,
                error = CASE WHEN error IS NULL THEN NULL
                             ELSE jsonb_build_object('code', error->'code', 'class',
                                                     error->'class', 'message', 'redacted') END,
                errors = '[]',
                updated_at = CASE WHEN redacted_at IS NULL THEN now() ELSE updated_at END,
                redacted_at = COALESCE(redacted_at, now())
WHERE id IN (SELECT id FROM locked)
  AND status IN ('completed', 'dead_letter', 'cancelled')
RETURNING id, created_at;

-- name: retention_redact_many_events
-- retention_redact_events for a batch: their history since the earliest of them was made.
UPDATE job_events SET detail = '{}'
WHERE job_id = ANY(%(ids)s::uuid[]) AND at >= %(since)s AND detail <> '{}'::jsonb;

-- name: retention_redact_many_attempts
UPDATE job_attempts SET error_message = NULL
WHERE job_id = ANY(%(ids)s::uuid[]) AND started_at >= %(since)s
  AND error_message IS NOT NULL;
