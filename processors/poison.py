"""Poison messages: records on a work topic that cannot be read as a job (bytes that do not
decode, an unknown schema, another event type) go to ``calmq.dlq`` with the reason.

They belong to no job row, so nothing in PostgreSQL changes with them: the record is
produced straight to Kafka with its original bytes (which a jsonb outbox row could not hold:
PostgreSQL's jsonb has no NUL character), and its offset is completed only after Kafka
acknowledged the copy. A poison message is never retried and never stops the partition.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from confluent_kafka import KafkaError, Message, Producer

from calmq import events, topics
from calmq.codec import EventCodec
from calmq.errors import InfrastructureError

__all__ = ["Poison", "PoisonSink"]


@dataclass(frozen=True)
class Poison:
    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes
    code: str
    reason: str


class PoisonSink:
    def __init__(self, producer: Producer, codec: EventCodec) -> None:
        self.producer = producer
        self.codec = codec

    def _send(self, records: list[Poison]) -> None:
        failed: list[KafkaError] = []

        def acked(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                failed.append(err)

        for p in records:
            dead = events.dead_lettered(
                None,
                errors=[{"attempt": 0, "code": p.code, "class": "input",
                         "message": p.reason[:1000]}],
                source_topic=p.topic,
            )
            dead["raw_value"] = p.value
            value = self.codec.encode("job.dead_lettered", dead)
            headers: list[tuple[str, str | bytes | None]] = [("calmq-error-code", p.code.encode()),
                       ("calmq-source", f"{p.topic}[{p.partition}]@{p.offset}".encode())]
            self.producer.produce(topics.DLQ, value=value, key=p.key, headers=headers,
                                  on_delivery=acked)
        left = self.producer.flush(30)
        if left or failed:
            raise InfrastructureError(
                f"calmq.dlq did not acknowledge {left + len(failed)} poison records")

    async def send(self, records: list[Poison]) -> None:
        """Produce the records and wait for Kafka's acknowledgement (off the event loop)."""
        if records:
            await asyncio.to_thread(self._send, records)
