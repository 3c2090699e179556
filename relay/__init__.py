"""The outbox relay: the only path from PostgreSQL to Kafka.

``cdc`` (the default) streams outbox inserts from a logical replication slot, decoded by
``pgoutput``; ``polling`` pages the outbox table for databases without logical
replication; ``publisher`` turns outbox rows into Kafka records exactly as Debezium's Outbox
Event Router would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from calmq.relay.cdc import CdcRelay, PendingTransactions, drop_slot
from calmq.relay.polling import PollingRelay
from calmq.relay.publisher import OutboxRow, Publisher

if TYPE_CHECKING:
    from calmq.settings import Settings

__all__ = ["CdcRelay", "OutboxRow", "PendingTransactions", "PollingRelay", "Publisher",
           "drop_slot", "make_relay"]


def make_relay(settings: Settings, publisher: Publisher) -> CdcRelay | PollingRelay:
    """The relay the settings ask for (``relay_mode``), publishing through ``publisher``."""
    if settings.relay_mode == "polling":
        return PollingRelay(settings.effective_relay_database_url, publisher,
                            batch=settings.relay_batch,
                            idle_seconds=settings.relay_idle_ms / 1000,
                            retention_seconds=settings.outbox_retention_seconds)
    return CdcRelay(
        settings.effective_relay_database_url, publisher,
        slot=settings.relay_slot, publication=settings.relay_publication,
        retention_seconds=settings.outbox_retention_seconds,
        housekeeping_seconds=settings.relay_housekeeping_seconds,
        prune_batch=settings.relay_prune_batch, wal_warn_bytes=settings.relay_wal_warn_bytes,
    )
