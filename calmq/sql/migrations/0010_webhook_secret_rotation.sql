-- Webhook secret rotation (issue 15): `calmq tenants webhook-secret NAME --rotate` makes a
-- new secret and keeps the one it replaces until webhook_secret_previous_until, so that
-- receivers can switch without losing a delivery: meanwhile every delivery carries a
-- Standard Webhooks signature under each secret. Past that time the previous secret is
-- ignored by every reader, and the next rotation overwrites it.
ALTER TABLE tenants ADD COLUMN webhook_secret_previous text;
ALTER TABLE tenants ADD COLUMN webhook_secret_previous_until timestamptz;
