"""Probes a command runs before it uses a part: Kafka, the schema registry, PostgreSQL.

Each answers within CONNECT_TIMEOUT_SECONDS or raises a CalmqError whose one line names the
part's address (``kafka_unreachable``, ``registry_unreachable``, ``database_unreachable``),
so a person at a terminal gets the answer in seconds instead of a client library's retries.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from calmq.cli.connect import CONNECT_TIMEOUT_SECONDS, unreachable
from calmq.errors import InfrastructureError

if TYPE_CHECKING:
    from confluent_kafka.admin import AdminClient

    from calmq.kafka import Connection
    from calmq.settings import Settings

__all__ = ["check_database", "check_registry", "kafka_config", "kafka_unreachable",
           "open_admin"]


def _quiet_logger() -> logging.Logger:
    """A logger for librdkafka that drops its lines: its "Connection refused" retries would
    otherwise go to stderr every second, where the one error line we print belongs."""
    log = logging.getLogger("calmq.cli.librdkafka")
    log.addHandler(logging.NullHandler())
    log.propagate = False
    return log


def kafka_config(connection: Connection, **extra: Any) -> dict[str, Any]:
    """A command's Kafka client: connects within the timeout and keeps librdkafka quiet.
    ``connection``: calmq.kafka.connection_config(settings), or a bare bootstrap string."""
    base = {"bootstrap.servers": connection} if isinstance(connection, str) else dict(connection)
    return {
        **base,
        "socket.connection.setup.timeout.ms": CONNECT_TIMEOUT_SECONDS * 1000,
        "logger": _quiet_logger(),
        **extra,
    }


def kafka_unreachable(bootstrap: str, exc: object) -> InfrastructureError:
    # A KafkaError's own text ("Failed to get metadata: ...") rather than its repr.
    text = getattr(exc, "str", None)
    reason = (text() if callable(text) else str(exc)).strip() or type(exc).__name__
    return InfrastructureError(
        f"Kafka at {bootstrap} is not reachable ({reason}): {_UNREACHABLE_HINT}",
        code="kafka_unreachable")


_UNREACHABLE_HINT = "check CALMQ_KAFKA_BOOTSTRAP, or start the local stack with `calmq dev up`"


def open_admin(connection: Connection) -> tuple[AdminClient, Any]:
    """An admin client and the cluster's metadata; fails fast when no broker answers, and
    with the setting to change when the brokers refuse the client's security settings."""
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    from calmq.kafka import check_connection

    config = kafka_config(connection)
    bootstrap = str(config["bootstrap.servers"])
    check_connection({k: v for k, v in config.items() if k != "logger"},
                     CONNECT_TIMEOUT_SECONDS, hint=_UNREACHABLE_HINT)
    admin = AdminClient(config)
    try:
        metadata = admin.list_topics(timeout=CONNECT_TIMEOUT_SECONDS)
    except KafkaException as exc:
        raise kafka_unreachable(bootstrap, exc.args[0] if exc.args else exc) from exc
    return admin, metadata


def check_registry(settings: Settings) -> None:
    """The schema registry answers ``GET /subjects`` within the timeout, with the
    settings' credentials and CA (calmq.codec.check_registry)."""
    from calmq.codec import check_registry as probe
    from calmq.codec import registry_config

    probe(settings.schema_registry_url, registry_config(settings), CONNECT_TIMEOUT_SECONDS)


def check_database(settings: Settings) -> None:
    """The same fast probe as ``open_store``, for commands that connect synchronously."""
    import psycopg

    try:
        psycopg.connect(settings.database_url, connect_timeout=CONNECT_TIMEOUT_SECONDS).close()
    except psycopg.Error as exc:
        raise unreachable(settings.database_url, exc) from exc
