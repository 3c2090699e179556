"""The outbox: events that leave calmq, written in the same transaction as the change.

Every event is an ``OutboxEntry`` made by ``entry`` and written by ``insert`` (a worker's
finished attempts: by calmq.data.attempts, in the statement that moves the jobs). The relay
publishes each row to the topic of its route (``aggregatetype``), keyed by ``key``
(``aggregateid``), with ``id`` and ``eventType`` headers (Debezium's Outbox Event Router).
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

from calmq import sql

__all__ = ["OutboxEntry", "entry", "insert"]


@dataclass(frozen=True, slots=True)
class OutboxEntry:
    """One outbox row: the event ``payload`` of ``type``, bound for ``route``."""

    id: str
    route: str
    type: str
    key: str
    payload: dict[str, Any]
    headers: dict[str, str]

    def params(self) -> dict[str, Any]:
        """The parameters of the ``insert_outbox`` query."""
        return {"id": self.id, "route": self.route, "aggregateid": self.key, "type": self.type,
                "payload": Jsonb(self.payload), "headers": Jsonb(self.headers)}

    def as_json(self, n: int) -> dict[str, Any]:
        """This entry as an element of a ``finish_attempts`` row's ``outbox`` array (``n``:
        its place, which keeps the events of one job in order)."""
        return {"id": self.id, "route": self.route, "type": self.type, "key": self.key,
                "payload": self.payload, "headers": self.headers, "n": n}


def entry(
    route: str,
    event_type: str,
    payload: dict[str, Any],
    *,
    key: uuid.UUID | str,
    trace_parent: str | None = None,
    headers: dict[str, str] | None = None,
) -> OutboxEntry:
    """The outbox entry of an event built by calmq.events (its ``event_id`` is the row's id).

    ``key`` is the Kafka key (the job id: a job's events stay in order on one partition);
    ``trace_parent`` goes on as the ``traceparent`` header, so every event of a job carries
    the trace of the request that created it; ``headers`` adds others (e.g. retry routing).
    """
    found = dict(headers) if headers else {}
    if trace_parent:
        found["traceparent"] = trace_parent
    return OutboxEntry(str(payload["event_id"]), route, event_type, str(key), payload, found)


async def insert(conn: psycopg.AsyncConnection[Any], entries: Sequence[OutboxEntry]) -> None:
    """Write ``entries`` on ``conn``, inside the caller's transaction (the change they
    announce commits with them)."""
    query = sql.queries()["insert_outbox"]
    if len(entries) == 1:
        await conn.execute(query, entries[0].params())
        return
    async with conn.cursor() as cur:
        await cur.executemany(query, [e.params() for e in entries])
