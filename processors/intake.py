"""Intake: polled messages -> requests to run a job (the first stage of a worker).

Each message of a batch is decoded (calmq's Avro, or the Debezium connector's JSON named by
its ``eventType`` header); what cannot be read as a ``job.requested`` is poison: it goes to
``calmq.dlq`` with its reason and original bytes, and only once Kafka acknowledged the copy
is its offset marked done. A schema registry that is away is waited out, never taken for
poison. The rest become ``Request``s for admission and the claim.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

from confluent_kafka import Message

from calmq.codec import EventCodec, decode_message
from calmq.errors import ContractError, InfrastructureError
from calmq.jobs import Priority
from calmq.kafka import header
from calmq.processors import metrics
from calmq.processors.offsets import OffsetTracker, headers_of, position_of
from calmq.processors.poison import Poison, PoisonSink
from calmq.processors.request import Request
from calmq.retrying import retry_forever

__all__ = ["Intake"]

log = logging.getLogger(__name__)


class Intake:
    # Messages decoded between two turns of the event loop: a claim batch of 500 decoded in
    # one step held timers and heartbeats back (bench longcalls).
    STEP_WORK = 64

    def __init__(self, codec: EventCodec, poison: PoisonSink, tracker: OffsetTracker) -> None:
        self.codec = codec
        self.poison = poison
        self.tracker = tracker

    async def read(self, batch: list[Message]) -> list[Request]:
        """The batch's job requests; its poison is in calmq.dlq and acknowledged."""
        wanted: list[Request] = []
        poison: list[Poison] = []
        for i, msg in enumerate(batch):
            if i and i % self.STEP_WORK == 0:
                await asyncio.sleep(0)
            position = position_of(msg)
            try:
                event_type, event = await self._decode(
                    msg.value() or b"", header(headers_of(msg), "eventType"))
                if event_type != "job.requested":
                    raise ContractError(f"{event_type} does not belong on a work topic",
                                        code="unexpected_event")
                wanted.append(Request(
                    position, uuid.UUID(str(event["job_id"])), str(event["step"]),
                    str(event.get("workflow") or ""), str(event.get("tenant_id") or ""),
                    str(event.get("priority") or Priority.BULK), msg))
            except Exception as exc:  # noqa: BLE001 - any unreadable message is poison, not a crash loop
                # (_decode waits out the registry being away: what reaches here is the
                # message's own fault.)
                code = exc.code if isinstance(exc, ContractError) else "undecodable"
                log.warning("poison message at %s: %s", position, exc)
                (topic, partition), offset = position
                poison.append(Poison(topic, partition, offset, msg.key(), msg.value() or b"",
                                     code, str(exc)))
        if poison:
            await retry_forever("sending poison messages to calmq.dlq failed",
                                lambda: self.poison.send(poison))
            for p in poison:
                self.tracker.done((p.topic, p.partition), p.offset)
            metrics.POISON.inc(len(poison))
        return wanted

    async def _decode(self, data: bytes, event_type: str | None) -> tuple[str, dict[str, Any]]:
        """Decode a message; a registry that is away is waited out.

        A schema the codec has not cached is fetched in a thread (the registry call blocks,
        and heartbeats and commits must keep running meanwhile)."""
        knows = getattr(self.codec, "knows", None)

        async def once() -> tuple[str, dict[str, Any]]:
            if knows is None or knows(data):
                return decode_message(self.codec, data, event_type)
            return await asyncio.to_thread(decode_message, self.codec, data, event_type)

        return await retry_forever("the schema registry is unavailable", once,
                                   retry_on=(InfrastructureError,))
