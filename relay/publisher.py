"""Outbox rows -> Kafka records, as Debezium's Outbox Event Router would publish them.

topic = ``calmq.`` + aggregatetype (or any ``topic_replacement`` with ``${routedByValue}``,
Debezium's ``route.topic.replacement``), key = aggregateid (the job id), value = the payload in
Avro, headers ``id`` (event id) and ``eventType`` plus the row's own headers (traceparent,
retry bookkeeping). A payload that does not fit its schema, or a row routed to a topic that
does not exist, goes to ``calmq.dlq`` with the reason instead of stopping the relay: the
relay publishes every pool's rows in one commit order, so one row it cannot place would
otherwise hold back all the others (and a relay that crashes on it crashes again on restart).

A record too large for Kafka (librdkafka's ``message.max.bytes``, refused at ``produce``, or
the topic's ``max.message.bytes``, refused by the broker in the delivery report) is the
row's fault in the same way: retrying it would resume from the same slot position forever
and publish nothing for any tenant again. The broker refuses a whole batch for its largest
record, so a record refused in a delivery report is first sent again alone (after the
records in flight): only one refused on its own is the row's fault. Such a row goes to
``calmq.dlq`` as a
``job.dead_lettered`` naming the job, with the first ``_EXCERPT_BYTES`` of its payload and
the error code ``record_too_large``; ``calmq_relay_rejected_total{code}`` counts every
rejection and the ``CalmqRelayRejectedRecords`` alert fires on it.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from prometheus_client import Counter

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
# A record (or the batch holding only it) larger than the producer's message.max.bytes or
# the topic's max.message.bytes: librdkafka's MSG_SIZE_TOO_LARGE, the broker's
# MESSAGE_TOO_LARGE / RECORD_TOO_LARGE (the same code, 10) and RECORD_LIST_TOO_LARGE.
_TOO_LARGE = (KafkaError.MSG_SIZE_TOO_LARGE, KafkaError.RECORD_LIST_TOO_LARGE)
# How much of a rejected row's payload its DLQ record carries (raw_value): enough to see
# whose job it was and what it held, far below any record limit.
_EXCERPT_BYTES = 8 * 1024


@cache
def _rejected_total() -> Counter:
    # Created on first use, not at import; the label is a stable error code (bounded).
    return Counter("calmq_relay_rejected_total",
                   "Outbox rows published to calmq.dlq instead of their topic, by reason",
                   ["code"])


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
        # Rows Kafka refused as too large in a delivery report, to reject once reports are
        # served (producing from inside librdkafka's callback could block on a full queue).
        self._oversized: list[tuple[OutboxRow, Callable[[], None] | None, KafkaError]] = []
        # Records refused in a batch with others: each is sent again on its own first.
        self._resend: list[tuple[_Record, OutboxRow, Callable[[], None] | None]] = []
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
            self._reject(row, exc, on_ack, headers)
            return
        record = _Record(topic, row.aggregateid.encode(), value, headers)
        try:
            self._produce(record, self._reported(row, on_ack, record))
        except KafkaException as exc:
            error = exc.args[0]
            if error.code() not in _TOO_LARGE:
                raise self._infrastructure(topic, exc) from exc
            self._reject(row, _too_large(row, len(value), error), on_ack)

    def _reject(self, row: OutboxRow, exc: ContractError, on_ack: Callable[[], None] | None,
                headers: list[tuple[str, str | bytes | None]] | None = None) -> None:
        """Publish ``row``'s rejection to calmq.dlq; ``on_ack`` runs once that is acked."""
        self.rejected += 1
        _rejected_total().labels(exc.code).inc()
        log.warning("outbox row %s (job %s) rejected: %s", row.id, row.aggregateid,
                    exc.message)
        value = self.codec.encode(
            "job.dead_lettered", _rejection(row, exc, self.topic_for(row.aggregatetype)))
        # A too-large row's own headers stay behind (they may be what made it too large).
        kept: list[tuple[str, str | bytes | None]] = [
            *(headers if headers is not None else
              [("id", row.id.encode()), ("eventType", row.type.encode())]),
            ("calmq-error-code", exc.code.encode())]
        try:
            self._produce(_Record(topics.DLQ, row.aggregateid.encode(), value, kept),
                          self._reported(None, on_ack, None))
        except KafkaException as err:
            raise self._infrastructure(topics.DLQ, err) from err

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

    def _reported(
        self, row: OutboxRow | None, on_ack: Callable[[], None] | None,
        record: _Record | None,
    ) -> Callable[[KafkaError | None, Message], None]:
        """The delivery report of one record: ``on_ack`` once acked; a refusal as too large
        of ``row`` (None: a rejection, never refused so) is sent again alone (``record``) or,
        sent alone already (None), rejected; any other refusal fails."""
        if row is None and on_ack is None:
            return self._on_delivery

        def report(err: KafkaError | None, _msg: Message) -> None:
            if err is None:
                if on_ack is not None:
                    on_ack()
            elif row is not None and err.code() in _TOO_LARGE:
                if record is not None:
                    self._resend.append((record, row, on_ack))
                else:
                    self._oversized.append((row, on_ack, err))
            else:
                self._failed.append(err)

        return report

    def _produce(
        self, record: _Record, callback: Callable[[KafkaError | None, Message], None]
    ) -> None:
        try:
            produce(self.producer, record.topic, record.key, record.value,
                    headers=record.headers, on_delivery=callback)
        except KafkaException as exc:
            # librdkafka refuses at once a topic its metadata says is gone (deleted since
            # _require_topic saw it): forget it, so the next row asks the broker again.
            if exc.args[0].code() in _NO_TOPIC:
                self._topics.discard(record.topic)
            raise

    @staticmethod
    def _infrastructure(topic: str, exc: KafkaException) -> InfrastructureError:
        return InfrastructureError(f"Kafka refused a record for {topic}: {exc}")

    def _reject_oversized(self) -> None:
        """Settle the rows the broker refused as too large (reported since the last call):
        one refused in a batch is sent again alone, one refused alone is rejected."""
        while self._resend or self._oversized:
            if self._resend:
                # The broker judged the batch by its largest record: the others in it were
                # refused with it. Drained first, so this record travels in a batch alone.
                self._drain()
                resend, self._resend = self._resend, []
                for record, row, on_ack in resend:
                    try:
                        self._produce(record, self._reported(row, on_ack, None))
                    except KafkaException as exc:
                        raise self._infrastructure(record.topic, exc) from exc
                    self._drain()
            while self._oversized:
                row, on_ack, err = self._oversized.pop(0)
                self._reject(row, _too_large(row, None, err), on_ack)

    def _drain(self, timeout: float = 30.0) -> None:
        remaining = self.producer.flush(timeout)
        if remaining:
            raise InfrastructureError(f"{remaining} records not acknowledged by Kafka in time")

    def poll(self, timeout: float = 0.0) -> None:
        """Serve delivery reports (runs ``on_ack`` callbacks); raise if Kafka refused any."""
        self.producer.poll(timeout)
        self._reject_oversized()
        self._raise_failed()

    def _raise_failed(self) -> None:
        if self._failed:
            failed, self._failed = self._failed, []
            raise InfrastructureError(f"Kafka refused {len(failed)} records: {failed[0]}")

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until Kafka acknowledged every record sent; raise if any was not."""
        while True:
            self._drain(timeout)
            if not self._oversized and not self._resend:
                break
            self._reject_oversized()  # their rejections are flushed on the next turn
        self._raise_failed()


@dataclass(frozen=True, slots=True)
class _Record:
    """One record as produced: kept while it may have to be sent again alone."""

    topic: str
    key: bytes
    value: bytes
    headers: list[tuple[str, str | bytes | None]]


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
        "raw_value": _excerpt(row.payload),
        "at": int(time.time() * 1000),
    }


def _excerpt(payload: Any) -> bytes:
    """The payload as JSON, cut to ``_EXCERPT_BYTES``: a rejection must itself fit."""
    return json.dumps(payload, default=str).encode()[:_EXCERPT_BYTES]


def _too_large(row: OutboxRow, size: int | None, err: KafkaError) -> ContractError:
    encoded = f" ({size} bytes encoded)" if size is not None else ""
    return ContractError(
        f"the {row.type} event of job {row.aggregateid}{encoded} is larger than Kafka takes "
        f"({err.name()}: message.max.bytes of the relay's producer, or max.message.bytes "
        f"of its topic; setting kafka_max_message_bytes); raw_value holds its first "
        f"{_EXCERPT_BYTES} bytes", code="record_too_large")


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)
