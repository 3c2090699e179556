-- The CDC relay's memory of the replication slots it made. A slot only streams what commits
-- after it was created, so the relay publishes the outbox rows already committed at that
-- point from the snapshot the slot exported. The row is written (caught_up_at NULL) before
-- the slot is made and completed after that catch-up: a slot whose row is still pending
-- (the relay died in between) is dropped and made again, never trusted. A slot with no row
-- at all was made by someone else (Debezium's connector on the same slot name) and is
-- adopted as it is: it confirmed only what it published.
CREATE TABLE relay_slots (
    slot_name         text PRIMARY KEY,
    consistent_lsn    pg_lsn,
    created_at        timestamptz NOT NULL DEFAULT now(),
    caught_up_at      timestamptz
);
