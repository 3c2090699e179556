"""Outbox rows -> Kafka records, as Debezium's Outbox Event Router would publish them.

topic = ``calmq.`` + aggregatetype, key = aggregateid (the job id), value = the payload in
Avro, headers ``id`` (event id) and ``eventType`` plus the row's own headers (traceparent,
retry bookkeeping). A payload that does not fit its schema goes to ``calmq.dlq`` with the
reason instead of stopping the relay.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, Message, Producer

from calmq import topics
from calmq.codec import EventCodec
from calmq.errors import ContractError, InfrastructureError

__all__ = ["OutboxRow", "Publisher"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class OutboxRow:
    id: str
    aggregatetype: str
    aggregateid: str
    type: str
    payload: dict[str, Any]
    headers: dict[str, str]


class Publisher:
    """Produces outbox rows with an idempotent producer and waits for every ack."""

    def __init__(self, producer: Producer, codec: EventCodec) -> None:
        self.producer = producer
        self.codec = codec
        self._failed: list[KafkaError] = []
        self.rejected = 0  # rows routed to the DLQ because their payload did not fit

    def _on_delivery(self, err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            self._failed.append(err)

    def send(self, row: OutboxRow) -> None:
        headers = [("id", row.id.encode()), ("eventType", row.type.encode())]
        headers += [(k, str(v).encode()) for k, v in row.headers.items()]
        payload = row.payload
        if isinstance(payload, dict) and isinstance(payload.get("raw_value"), str):
            # jsonb holds no bytes: calmq.events stores an unreadable message as latin-1 text.
            payload = {**payload, "raw_value": payload["raw_value"].encode("latin-1")}
        try:
            value = self.codec.encode(row.type, payload)
            topic = topics.topic_for_route(row.aggregatetype)
        except ContractError as exc:
            self.rejected += 1
            log.warning("outbox row %s rejected: %s", row.id, exc.message)
            value = self.codec.encode("job.dead_lettered", _rejection(row, exc))
            topic = topics.DLQ
            headers.append(("calmq-error-code", exc.code.encode()))
        self._produce(topic, row.aggregateid.encode(), value, headers)

    def _produce(self, topic: str, key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> None:
        while True:
            try:
                self.producer.produce(
                    topic, value=value, key=key, headers=headers, on_delivery=self._on_delivery
                )
                return
            except BufferError:
                # The local queue is full: serve delivery reports to make room, then retry.
                self.producer.poll(0.05)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until Kafka acknowledged every record sent; raise if any was not."""
        remaining = self.producer.flush(timeout)
        if remaining:
            raise InfrastructureError(f"{remaining} records not acknowledged by Kafka in time")
        if self._failed:
            failed, self._failed = self._failed, []
            raise InfrastructureError(f"Kafka refused {len(failed)} records: {failed[0]}")


def _rejection(row: OutboxRow, exc: ContractError) -> dict[str, Any]:
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
        "source_topic": topics.topic_for_route(row.aggregatetype),
        "raw_value": json.dumps(row.payload, default=str).encode(),
        "at": int(time.time() * 1000),
    }


def _str_or_none(value: Any) -> str | None:
    return None if value is None else str(value)
