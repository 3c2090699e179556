-- calmq schema, version 19 (issue 26): the fleet's view of each provider and model.
--
-- A bad key, a missing permission, a model the account cannot use or exhausted billing is
-- the fleet's configuration problem, not a job's: the provider and model are blocked here
-- (blocked_reason), every worker stops calling them, and their jobs wait queued
-- (jobs.waiting_reason 'provider_blocked') with no attempt counted, until a probe call
-- succeeds or `calmq provider unblock` lifts it. A rate limit pauses them until
-- paused_until (the provider's retry-after-ms / retry-after), fleet-wide, with or without a
-- token budget. The limits the provider states in its rate-limit headers are kept beside
-- (observed_*), for the budget and `calmq budget`.
CREATE TABLE provider_states (
    provider                       text NOT NULL,  -- kind:base URL, as budget_buckets
    model                          text NOT NULL,
    blocked_reason                 text,           -- NULL: not blocked
    blocked_code                   text,
    blocked_message                text,
    blocked_at                     timestamptz,
    paused_until                   timestamptz NOT NULL DEFAULT '-infinity',
    observed_tokens_per_minute     bigint,
    observed_requests_per_minute   bigint,
    observed_at                    timestamptz,
    updated_at                     timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (provider, model)
);
