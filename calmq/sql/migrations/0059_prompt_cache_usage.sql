-- Prompt caching (issue 46 item 3): of a job's and an attempt's input tokens, those the
-- provider read from its prompt cache (billed at the cached price) and those it wrote to it
-- (Anthropic's cache writes, billed above the input price), and what the cache saved in USD
-- against the same calls uncached (net: a write's premium counts against it).
-- Constant defaults: no table rewrite, so no lock held for long on a big jobs table.
SET LOCAL lock_timeout = '5s';
ALTER TABLE jobs
    ADD COLUMN cached_input_tokens bigint NOT NULL DEFAULT 0,
    ADD COLUMN cache_write_tokens  bigint NOT NULL DEFAULT 0,
    ADD COLUMN cache_saved_usd     numeric(20, 10) NOT NULL DEFAULT 0;
ALTER TABLE job_attempts
    ADD COLUMN cached_input_tokens bigint NOT NULL DEFAULT 0,
    ADD COLUMN cache_write_tokens  bigint NOT NULL DEFAULT 0,
    ADD COLUMN cache_saved_usd     numeric(20, 10) NOT NULL DEFAULT 0;
