-- Durable multi-step workflows and human review (docs/explanation/workflows.md).

-- A job waiting for a person holds no lease; this deadline is what the review timer reads.
ALTER TABLE jobs ADD COLUMN review_deadline_at timestamptz;
CREATE INDEX jobs_review_deadline ON jobs (review_deadline_at) WHERE status = 'awaiting_review';
CREATE INDEX jobs_awaiting_review ON jobs (tenant_id, updated_at, id)
    WHERE status = 'awaiting_review';

-- Each step's output, recorded in the same transaction that moves the job to its next step,
-- so that a crash resumes at the step that failed and a replayed step is skipped.
-- state: done (the step finished), pending_review (waiting for a person), approved
-- (a person accepted it, possibly with corrected fields), rejected.
CREATE TABLE step_outputs (
    job_id       uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    step         text NOT NULL,
    state        text NOT NULL CHECK (state IN ('done', 'pending_review', 'approved', 'rejected')),
    output       jsonb NOT NULL,
    model_output jsonb,            -- what the model said, kept when a reviewer corrects it
    confidence   double precision,
    reviewer     text,
    reviewed_at  timestamptz,
    recorded_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (job_id, step)
);

-- "Record then call then confirm": a step writes the intent before it calls an external
-- system and the answer after; a crash between the two is retried with the same key, and a
-- confirmed effect is never called again.
CREATE TABLE side_effects (
    job_id        uuid NOT NULL REFERENCES jobs (id) ON DELETE CASCADE,
    key           text NOT NULL,   -- the idempotency key handed to the external system
    state         text NOT NULL CHECK (state IN ('called', 'confirmed')),
    calls         integer NOT NULL DEFAULT 1,
    response      jsonb,
    called_at     timestamptz NOT NULL DEFAULT now(),
    confirmed_at  timestamptz,
    PRIMARY KEY (job_id, key)
);
