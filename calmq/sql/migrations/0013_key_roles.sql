-- Key roles (issue 18): what an API key may do. NULL keeps every tenant role (submit,
-- review, operate), so the keys made before this migration behave exactly as they did.
-- A platform key (made by `calmq tenants platform-key`) reads every tenant in the console.
ALTER TABLE api_keys ADD COLUMN roles text[];
ALTER TABLE api_keys ADD COLUMN platform boolean NOT NULL DEFAULT false;

-- What the reviewers of a pool can handle: the console shows the pending reviews against
-- it and says when a pool is past it (set from the console's overview by a platform key).
CREATE TABLE review_caps (
    pool        text PRIMARY KEY,
    cap         integer NOT NULL CHECK (cap > 0),
    updated_by  text NOT NULL,
    updated_at  timestamptz NOT NULL DEFAULT now()
);
