"""The outbox relay: the only path from PostgreSQL to Kafka.

``polling`` pages the outbox table; ``pgoutput`` decodes logical replication for the CDC
mode; ``publisher`` turns outbox rows into Kafka records exactly as Debezium's Outbox Event
Router would.
"""

from relay.polling import PollingRelay
from relay.publisher import OutboxRow, Publisher

__all__ = ["OutboxRow", "PollingRelay", "Publisher"]
