-- The CDC relay's memory of its replication slots. A slot only streams what commits after
-- it was created, so the relay publishes the outbox rows already committed at that point
-- from the snapshot the slot exported. A row here says that catch-up finished: a slot
-- without one (the relay died in between) is dropped and made again, never trusted.
CREATE TABLE relay_slots (
    slot_name         text PRIMARY KEY,
    consistent_lsn    pg_lsn NOT NULL,
    caught_up_at      timestamptz NOT NULL DEFAULT now()
);
