-- Tenants and API keys (calmq/data/tenants.py).

-- name: create_tenant
INSERT INTO tenants (id, name) VALUES (%(id)s, %(name)s) RETURNING id, name, created_at;

-- name: create_api_key
INSERT INTO api_keys (id, tenant_id, key_hash, key_prefix)
VALUES (%(id)s, %(tenant_id)s, %(key_hash)s, %(key_prefix)s);

-- name: tenant_for_key
-- roles NULL: a key made without roles keeps every tenant role (migration 0013).
SELECT t.id, t.name, k.key_prefix, k.roles, k.platform
FROM api_keys k JOIN tenants t ON t.id = k.tenant_id
WHERE k.key_hash = %(key_hash)s AND k.revoked_at IS NULL;

-- name: add_api_key
INSERT INTO api_keys (id, tenant_id, key_hash, key_prefix, roles, platform)
SELECT %(id)s, id, %(key_hash)s, %(key_prefix)s, %(roles)s::text[], %(platform)s
FROM tenants WHERE name = %(name)s
RETURNING key_prefix;

-- name: ensure_tenant
-- The tenant that holds the platform keys, made on first use.
INSERT INTO tenants (id, name) VALUES (%(id)s, %(name)s) ON CONFLICT (name) DO NOTHING;

-- name: revoke_api_keys
-- Revoke keys of a tenant by prefix (or all of them with prefix NULL); the NOTIFY tells
-- every API process to drop its auth cache at once instead of waiting for the TTL.
WITH revoked AS (
    UPDATE api_keys k SET revoked_at = now()
    FROM tenants t
    WHERE t.id = k.tenant_id AND t.name = %(name)s AND k.revoked_at IS NULL
      AND (%(key_prefix)s::text IS NULL OR k.key_prefix = %(key_prefix)s::text)
    RETURNING k.key_prefix
), woken AS (
    SELECT pg_notify('calmq_api_keys', '') FROM (SELECT 1 FROM revoked LIMIT 1) r
)
SELECT key_prefix, (SELECT count(*) FROM woken) AS notified FROM revoked;

-- name: tenant_webhook_secret
-- The current secret, and the previous one while its grace lasts (after a rotation).
SELECT webhook_secret,
       CASE WHEN webhook_secret_previous_until > now() THEN webhook_secret_previous END
           AS webhook_secret_previous,
       CASE WHEN webhook_secret_previous_until > now() THEN webhook_secret_previous_until END
           AS webhook_secret_previous_until
FROM tenants WHERE name = %(name)s;

-- name: rotate_webhook_secret
-- A new secret; the one it replaces still signs until now() + grace (a grace of 0 drops it
-- at once). Drawn like the column default of migration 0004: two random UUIDs, 244 bits.
UPDATE tenants
SET webhook_secret_previous = CASE WHEN %(grace_seconds)s > 0 THEN webhook_secret END,
    webhook_secret_previous_until =
        CASE WHEN %(grace_seconds)s > 0
             THEN now() + make_interval(secs => %(grace_seconds)s) END,
    webhook_secret = replace(gen_random_uuid()::text || gen_random_uuid()::text, '-', '')
WHERE name = %(name)s
RETURNING webhook_secret, webhook_secret_previous, webhook_secret_previous_until;

-- name: list_tenants
-- Every tenant with its keys (prefix, created, revoked) and when it last submitted a job:
-- keys record no use of their own, and a tenant's last job is found by the
-- jobs_tenant_created index in one probe.
SELECT t.id, t.name, t.created_at, t.weight,
       (SELECT max(j.created_at) FROM jobs j WHERE j.tenant_id = t.id) AS last_job_at,
       coalesce((SELECT json_agg(json_build_object(
                    'prefix', k.key_prefix, 'created_at', k.created_at,
                    'revoked_at', k.revoked_at, 'roles', k.roles,
                    'platform', k.platform) ORDER BY k.created_at)
                 FROM api_keys k WHERE k.tenant_id = t.id), '[]'::json) AS keys
FROM tenants t
WHERE %(name)s::text IS NULL OR t.name = %(name)s::text
ORDER BY t.name;

-- name: console_session_open
-- A console session for a valid key: the token's hash, until now() + seconds. Sessions
-- that ended (expired or signed out) are deleted on the way. No row: the key is unknown
-- or revoked.
WITH ended AS (
    DELETE FROM console_sessions WHERE expires_at < now() OR revoked_at IS NOT NULL
), key AS (
    SELECT k.id FROM api_keys k WHERE k.key_hash = %(key_hash)s AND k.revoked_at IS NULL
)
INSERT INTO console_sessions (token_hash, key_id, expires_at)
SELECT %(token_hash)s, key.id, now() + make_interval(secs => %(seconds)s) FROM key
RETURNING expires_at;

-- name: tenant_for_console_session
-- The tenant and key of a live session (not expired, not signed out, its key not
-- revoked), and how many seconds it has left.
SELECT t.id, t.name, k.key_prefix, k.roles, k.platform,
       extract(epoch FROM s.expires_at - now())::float8 AS seconds_left
FROM console_sessions s
JOIN api_keys k ON k.id = s.key_id
JOIN tenants t ON t.id = k.tenant_id
WHERE s.token_hash = %(token_hash)s AND s.revoked_at IS NULL AND s.expires_at > now()
  AND k.revoked_at IS NULL;

-- name: console_session_close
-- Sign-out: the session ends now, in every API process (their caches drop it on the
-- notification, as for a revoked key).
WITH closed AS (
    UPDATE console_sessions SET revoked_at = now()
    WHERE token_hash = %(token_hash)s AND revoked_at IS NULL
    RETURNING 1
)
SELECT pg_notify('calmq_api_keys', '') FROM closed;

-- name: set_results_topic
-- Where the tenant's results (and dead letters) go from the next event on; NULL: the shared
-- calmq.results. The outbox's trigger reads it (migration 0056).
UPDATE tenants SET results_topic = %(topic)s WHERE name = %(name)s RETURNING id;

-- name: results_topics
-- Every tenant's own results topic (NULL: the shared one), for `calmq topics create`.
SELECT name, results_topic FROM tenants ORDER BY name;
