-- The outbox (calmq/data/outbox.py), and the polling relay's reading and pruning of it.

-- name: insert_outbox
INSERT INTO outbox (id, aggregatetype, aggregateid, type, payload, headers)
VALUES (%(id)s, %(route)s, %(aggregateid)s, %(type)s, %(payload)s, %(headers)s);

-- name: outbox_page
-- Rows of transactions that committed: every transaction below the snapshot's xmin has
-- ended, so no row can still appear behind the cursor (docs/how-to/relay.md).
SELECT seq, id, aggregatetype, aggregateid, type, payload, headers, txid::text AS txid
FROM outbox
WHERE (txid, seq) > (%(txid)s::text::xid8, %(seq)s)
  AND txid < pg_snapshot_xmin(pg_current_snapshot())
ORDER BY txid, seq
LIMIT %(limit)s;

-- name: relay_cursor
SELECT txid::text AS txid, seq FROM relay_cursor WHERE name = %(name)s;

-- name: save_relay_cursor
INSERT INTO relay_cursor (name, txid, seq) VALUES (%(name)s, %(txid)s::text::xid8, %(seq)s)
ON CONFLICT (name) DO UPDATE SET txid = EXCLUDED.txid, seq = EXCLUDED.seq, updated_at = now();

-- name: prune_outbox
DELETE FROM outbox
WHERE (txid, seq) <= (%(txid)s::text::xid8, %(seq)s)
  AND created_at < now() - make_interval(secs => %(retention_seconds)s);
