"""A streamed step's text as rows (tables job_output_chunks and job_outputs, migration
0033): the chunks a worker writes as the model writes, announced on ``NOTIFY
calmq_job_output`` while an event stream follows the job (``follow``, table job_followers,
migration 0051); what a reader after a position needs; the compaction of a final job's
chunks into one text per step. How the chunks are cut and read in order is calmq.calls.publishing'.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Container, Sequence
from dataclasses import dataclass

import psycopg

from calmq.data.database import Database

__all__ = ["CHANNEL", "FOLLOW_REFRESH_SECONDS", "FOLLOW_TTL_SECONDS", "NOTIFY_BYTES",
           "CompactedOutput", "OutputChunk", "OutputRead", "Outputs", "StreamInfo",
           "job_payloads", "parse_payload", "payloads"]

# The channel every API process listens on (producers/notifications.py).
CHANNEL = "calmq_job_output"
# PostgreSQL refuses a NOTIFY payload of 8,000 bytes or more; a payload is kept under this.
NOTIFY_BYTES = 7_900
# How long a follower's row lives unless its stream refreshes it (FOLLOW_REFRESH_SECONDS):
# the row of a stream whose API process died stops the announcements this long after.
FOLLOW_TTL_SECONDS = 300.0
FOLLOW_REFRESH_SECONDS = 100.0


@dataclass(frozen=True, slots=True)
class OutputChunk:
    """A piece of one stream's text. ``stream``: the attempt's fencing token; ``offset``:
    the characters of the stream's text before it. ``text`` is None in a notification
    whose chunk did not fit the payload (the reader reads the row)."""

    job_id: uuid.UUID
    stream: int
    seq: int
    step: str
    attempt: int
    offset: int
    text: str | None

    @property
    def end(self) -> int:
        """The offset after this chunk (its text known)."""
        return self.offset + len(self.text or "")


@dataclass(frozen=True, slots=True)
class StreamInfo:
    """One stream of a job as its chunks show it; ``current``: the latest of its step."""

    stream: int
    step: str
    attempt: int
    seq: int
    current: bool


@dataclass(frozen=True, slots=True)
class CompactedOutput:
    """A final job's text of one step: its last stream, ``chunks`` long, as one text."""

    stream: int
    step: str
    attempt: int
    chunks: int
    text: str


@dataclass(frozen=True, slots=True)
class OutputRead:
    """What a reader after a position needs, read in one snapshot."""

    streams: list[StreamInfo]
    chunks: list[OutputChunk]
    compacted: list[CompactedOutput]


def _record(chunk: OutputChunk, text: bool = True) -> str:
    return json.dumps([str(chunk.job_id), chunk.stream, chunk.seq, chunk.step, chunk.attempt,
                       chunk.offset, chunk.text if text else None],
                      ensure_ascii=False, separators=(",", ":"))


def payloads(chunks: Sequence[OutputChunk], limit: int = NOTIFY_BYTES) -> list[str]:
    """The notifications of ``chunks``: JSON arrays of chunk records, each under ``limit``
    bytes; a chunk too long for any payload is announced without its text."""
    found: list[str] = []
    batch: list[str] = []
    size = 2  # the brackets
    for chunk in chunks:
        record = _record(chunk)
        length = len(record.encode())
        if length + 2 > limit:
            record = _record(chunk, text=False)
            length = len(record.encode())
        if batch and size + length + 1 > limit:
            found.append("[" + ",".join(batch) + "]")
            batch, size = [], 2
        batch.append(record)
        size += length + 1
    if batch:
        found.append("[" + ",".join(batch) + "]")
    return found


def job_payloads(chunks: Sequence[OutputChunk], limit: int = NOTIFY_BYTES
                 ) -> list[tuple[uuid.UUID, str]]:
    """``payloads`` of each job's chunks apart, with the job: a payload is announced only
    while its job has a follower (calmq/sql/outputs.sql, output_append)."""
    by_job: dict[uuid.UUID, list[OutputChunk]] = {}
    for chunk in chunks:
        by_job.setdefault(chunk.job_id, []).append(chunk)
    return [(job, payload) for job, group in by_job.items()
            for payload in payloads(group, limit)]


def parse_payload(payload: str, wanted: Container[str] | None = None
                  ) -> list[OutputChunk]:
    """The chunks of one notification (``payloads``' format); with ``wanted``, only those
    of the job ids in it (an API process passes on only its followers' jobs)."""
    return [OutputChunk(uuid.UUID(job), int(stream), int(seq), str(step), int(attempt),
                        int(offset), text)
            for job, stream, seq, step, attempt, offset, text in json.loads(payload)
            if wanted is None or job in wanted]


class Outputs:
    def __init__(self, db: Database) -> None:
        self._db = db

    async def append(self, chunks: Sequence[OutputChunk]) -> None:
        """Write a group of chunks and announce those of followed jobs, in one statement (a
        chunk written again, by a retried group, is not written twice; one of a deleted job
        is not written at all)."""
        announced = job_payloads(chunks)
        async with self._db.pool.connection() as conn:
            await conn.execute(self._db.q["output_append"], {
                "job_ids": [c.job_id for c in chunks], "streams": [c.stream for c in chunks],
                "seqs": [c.seq for c in chunks], "steps": [c.step for c in chunks],
                "attempts": [c.attempt for c in chunks],
                "offsets": [c.offset for c in chunks],
                "texts": [c.text or "" for c in chunks],
                "payloads": [p for _job, p in announced],
                "payload_jobs": [job for job, _p in announced]})

    async def follow(self, job_id: uuid.UUID, follower: uuid.UUID,
                     ttl_seconds: float = FOLLOW_TTL_SECONDS) -> None:
        """Say that ``follower`` (an event stream) follows the job's text, for ``ttl_seconds``
        unless said again: its chunks are announced from the commit of this on."""
        async with self._db.pool.connection() as conn:
            await conn.execute(self._db.q["output_follow"], {
                "id": job_id, "follower": follower, "ttl_seconds": ttl_seconds})

    async def unfollow(self, job_id: uuid.UUID, follower: uuid.UUID) -> None:
        """The stream ended. Best effort: a row left behind (the database away) expires."""
        try:
            async with self._db.pool.connection() as conn:
                await conn.execute(self._db.q["output_unfollow"],
                                   {"id": job_id, "follower": follower})
        except psycopg.Error:
            pass

    async def after(self, job_id: uuid.UUID, stream: int, seq: int) -> OutputRead:
        """The job's streams, its chunks after (``stream``, ``seq``) and its compacted
        texts, in one statement (one snapshot: a compaction is seen whole or not at all)."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["output_after"],
                                     {"id": job_id, "stream": stream, "seq": seq})
            rows = await cur.fetchall()
        read = OutputRead([], [], [])
        for r in rows:
            if r["kind"] == "stream":
                read.streams.append(StreamInfo(int(r["stream"]), r["step"], int(r["attempt"]),
                                               int(r["seq"]), bool(r["current"])))
            elif r["kind"] == "chunk":
                read.chunks.append(OutputChunk(job_id, int(r["stream"]), int(r["seq"]),
                                               r["step"], int(r["attempt"]), int(r["offset"]),
                                               r["text"]))
            else:
                read.compacted.append(CompactedOutput(int(r["stream"]), r["step"],
                                                      int(r["attempt"]), int(r["seq"]),
                                                      r["text"]))
        read.chunks.sort(key=lambda c: (c.stream, c.seq))
        return read

    async def compact(self, limit: int = 500) -> tuple[int, int]:
        """Compact the chunks of up to ``limit`` final jobs; returns (jobs, chunks)."""
        async with self._db.pool.connection() as conn:
            await conn.execute(self._db.q["output_followers_prune"])
            cur = await conn.execute(self._db.q["output_compact"], {"limit": limit})
            row = await cur.fetchone()
        return (int(row["jobs"]), int(row["chunks"])) if row else (0, 0)

    async def texts(self, job_id: uuid.UUID) -> list[CompactedOutput]:
        """A job's compacted text of each step, in the order they streamed."""
        async with self._db.pool.connection() as conn:
            cur = await conn.execute(self._db.q["output_text"], {"id": job_id})
            return [CompactedOutput(int(r["stream"]), r["step"], int(r["attempt"]),
                                    int(r["chunks"]), r["text"]) for r in await cur.fetchall()]
