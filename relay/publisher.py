"""Outbox rows -> Kafka records, as Debezium's Outbox Event Router would publish them.

topic = ``calmq.`` + aggregatetype (or any ``topic_replacement`` with ``${routedByValue}``,
Debezium's ``route.topic.replacement``), key = aggregateid (the job id), value = the payload in
Avro, headers ``id`` (event id) and ``eventType`` plus the row's own headers (traceparent,
retry bookkeeping). A payload that does not fit its schema, or a row routed to a topic that
does not exist, goes to ``calmq.dlq`` with the reason instead of stopping the relay: the
relay publishes every pool's rows in one commit order, so one row it cannot place would
otherwise hold back all the others (and a relay that crashes on it crashes again on restart).
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from calmq import topics
from calmq.codec import EventCodec
from calmq.data.relay import OutboxRow
from calmq.errors import ContractError, InfrastructureError
from calmq.kafka import produce

__all__ = ["ROUTED_BY_VALUE", "TOPIC_REPLACEMENT", "OutboxRow", "Publisher"]

ROUTED_BY_VALUE = "${routedByValue}"
# calmq's own rule (topics.topic_for_route): calmq.<pool>.<priority>, calmq.retry.<tier>, ...
TOPIC_REPLACEMENT = topics.PREFIX + ROUTED_BY_VALUE

log = logging.getLogger(__name__)

# How long a topic found missing stays missing before the broker is asked again: rows for it
# go to the DLQ without a metadata round trip each, and a topic created meanwhile is used
# within this long.
_MISSING_TOPIC_TTL = 10.0
_METADATA_TIMEOUT = 5.0
_NO_TOPIC = (KafkaError.UNKNOWN_TOPIC_OR_PART, KafkaError._UNKNOWN_TOPIC)


class Publisher:
    """Produces outbox rows with an idempotent producer and waits for every ack."""

    def __init__(
        self, producer: Producer, codec: EventCodec, *, topic_replacement: str = TOPIC_REPLACEMENT
    ) -> None:
        self.producer = producer
        self.codec = codec
        # Debezium's route.topic.replacement: ${routedByValue} is the row's aggregatetype.
        self.topic_replacement = topic_replacement
        self._failed: list[KafkaError] = []
        self.rejected = 0  # rows routed to the DLQ because their payload or topic did not fit
        self._topics: set[str] = set()  # seen in the broker's metadata
        self._missing: dict[str, float] = {}  # topic -> when it was found missing

    def _on_delivery(self, err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            self._failed.append(err)

    def send(self, row: OutboxRow, on_ack: Callable[[], None] | None = None) -> None:
        """Produce ``row`` (or its rejection to the DLQ); ``on_ack`` runs once Kafka acked it.

        Acks are served by ``poll``/``flush``; a refused record never calls ``on_ack`` and
        makes the next ``flush`` raise, so a caller that confirms on acks never skips it.
        """
        headers: list[tuple[str, str | bytes | None]] = [
            ("id", row.id.encode()), ("eventType", row.type.encode())]
        payload = row.payload
        if isinstance(payload, dict) and isinstance(payload.get("raw_value"), str):
            # jsonb holds no bytes: calmq.events stores an unreadable message as latin-1 text.
            payload = {**payload, "raw_value": payload["raw_value"].encode("latin-1")}
        try:
            if not isinstance(row.headers, dict):
                raise ContractError(
                    f"outbox headers must be a JSON object, not {type(row.headers).__name__}",
                    code="bad_outbox_headers",
                )
            headers += [(k, str(v).encode()) for k, v in row.headers.items()]
            value = self.codec.encode(row.type, payload)
            topic = self.topic_for(row.aggregatetype)
            self._require_topic(topic)
        except ContractError as exc:
            self.rejected += 1
            log.warning("outbox row %s rejected: %s", row.id, exc.message)
            value = self.codec.encode(
                "job.dead_lettered", _rejection(row, exc, self.topic_for(row.aggregatetype)))
            topic = topics.DLQ
            headers.append(("calmq-error-code", exc.code.encode()))
        self._produce(topic, row.aggregateid.encode(), value, headers, on_ack)

    def _require_topic(self, topic: str) -> None:
        """Raise ``unknown_topic`` unless the broker has ``topic`` (asked once, then cached)."""
        if topic in self._topics:
            return
        missing_since = self._missing.get(topic)
        if missing_since is None or time.monotonic() - missing_since > _MISSING_TOPIC_TTL:
            try:
                meta = self.producer.list_topics(topic, timeout=_METADATA_TIMEOUT)
            except KafkaException as exc:
                # The broker did not answer: not the row's fault. The relay's reconnect loop
                # retries, and the row is sent again from the slot or cursor.
                raise InfrastructureError(f"Kafka metadata for {topic}: {exc}") from exc
            found = meta.topics.get(topic)
            if found is not None and found.error is None and found.partitions:
                self._topics.add(topic)
                self._missing.pop(topic, None)
                return
            self._missing[topic] = time.monotonic()
        raise ContractError(
            f"topic {topic} does not exist: create the pool's topics (`calmq topics create "
            "--pool <pool>`), then submit the job again", code="unknown_topic")

    def topic_for(self, route: str) -> str:
        """The topic of a route (aggregatetype), by the replacement rule."""
        return self.topic_replacement.replace(ROUTED_BY_VALUE, route)

    def _delivered(
        self, on_ack: Callable[[], None]
    ) -> Callable[[KafkaError | None, Message], None]:
        def report(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                self._failed.append(err)
            else:
                on_ack()

        return report

    def _produce(
        self,
        topic: str,
        key: bytes,
        value: bytes,
        headers: list[tuple[str, str | bytes | None]],
        on_ack: Callable[[], None] | None = None,
    ) -> None:
        callback = self._on_delivery if on_ack is None else self._delivered(on_ack)
        try:
            produce(self.producer, topic, key, value, headers=headers, on_delivery=callback)
        except KafkaException as exc:
            # librdkafka refuses at once a topic its metadata says is gone (deleted since
            # _require_topic saw it): forget it, so the next row asks the broker again.
            if exc.args[0].code() in _NO_TOPIC:
                self._topics.discard(topic)
            raise InfrastructureError(f"Kafka refused a record for {topic}: {exc}") from exc

    def poll(self, timeout: float = 0.0) -> None:
        """Serve delivery reports (runs ``on_ack`` callbacks); raise if Kafka refused any."""
        self.producer.poll(timeout)
        self._raise_failed()

    def _raise_failed(self) -> None:
        if self._failed:
            failed, self._failed = self._failed, []
            raise InfrastructureError(f"Kafka refused {len(failed)} records: {failed[0]}")

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until Kafka acknowledged every record sent; raise if any was not."""
        remaining = self.producer.flush(timeout)
        if remaining:
            raise InfrastructureError(f"{remaining} records not acknowledged by Kafka in time")
        self._raise_failed()


def _rejection(row: OutboxRow, exc: ContractError, source_topic: str) -> dict[str, Any]:
    payload = row.payload if isinstance(row.payload, dict) else {}
    return {
        "event_id": str(uuid.uuid4()),
        "job_id": row.aggregateid,
        "tenant_id": _str_or_none(payload.get("tenant_id")),
        "workflow": _str_or_none(payload.get("workflow")),
        "step": _str_or_none(payload.get("step")),
        "attempt": 0,
        "errors": [{"attempt": 0, "code": exc.code, "class": "input", "message": exc.message}],
        "last_event": row.type,
        "source_topic": source_topic,
        "raw_value": json.dumps(row.payload, default=str).encode(),
        "at": int(time.time() * 1000),
    }


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)
