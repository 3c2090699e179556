-- The console's sign-in sessions (issue 27): the cookie held the API key itself, with no
-- expiry, so a copied cookie was the key for as long as the key lived. A session is now a
-- random token of its own: the cookie holds the token, this table its SHA-256 hash (never
-- the token), the key it was opened with, and when it ends. A session stops at its expiry,
-- at sign-out (revoked_at), and when its key is revoked (the lookup joins the key); the
-- NOTIFY on calmq_api_keys that a sign-out sends drops it from every API process's cache.
CREATE TABLE console_sessions (
    token_hash  bytea PRIMARY KEY,
    key_id      uuid NOT NULL REFERENCES api_keys (id) ON DELETE CASCADE,
    created_at  timestamptz NOT NULL DEFAULT now(),
    expires_at  timestamptz NOT NULL,
    revoked_at  timestamptz
);
CREATE INDEX console_sessions_key ON console_sessions (key_id);
-- Sessions that ended are deleted when the next one opens (console_session_open).
CREATE INDEX console_sessions_expires ON console_sessions (expires_at);
