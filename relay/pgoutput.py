"""Decoder for PostgreSQL's ``pgoutput`` logical replication plugin, protocol v1.

The relay starts replication with ``proto_version '1'`` and receives one
pgoutput message per XLogData payload (psycopg2's ``msg.payload`` with
``decode=False``). Only what the relay acts on is decoded in full: Begin,
Commit, Relation and Insert. The other protocol-v1 messages (Origin, Type,
Update, Delete, Truncate and logical decoding Message) are still checked for
structure, so that a corrupt stream fails loudly, but come back as
:class:`Ignored`.

Message kinds that only exist in protocol v2+ (streaming, two-phase commit)
are rejected rather than ignored: with v1 they mean the slot was started with
the wrong options, and skipping them would silently misparse the streamed
changes that follow.

Text values are decoded as UTF-8, which assumes a UTF8 server encoding (the
walsender sends values in the database encoding, never converted).

Reference: PostgreSQL docs, "Logical Replication Message Formats".
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from struct import Struct
from typing import Final, TypeAlias

__all__ = [
    "UNCHANGED_TOAST",
    "Begin",
    "Column",
    "Commit",
    "Ignored",
    "Insert",
    "Message",
    "PgoutputDecodeError",
    "Relation",
    "UnchangedToast",
    "Value",
    "decode",
    "row_as_dict",
]


class UnchangedToast(enum.Enum):
    """Type of :data:`UNCHANGED_TOAST`; an enum so it is a typed singleton."""

    UNCHANGED_TOAST = "unchanged-toast"

    def __repr__(self) -> str:
        return "UNCHANGED_TOAST"


# A TOASTed column the server did not resend because it did not change. The
# real value is not in the stream, so it must never pass for a str or NULL.
UNCHANGED_TOAST: Final = UnchangedToast.UNCHANGED_TOAST

Value: TypeAlias = str | UnchangedToast | None


class PgoutputDecodeError(ValueError):
    """A payload is empty, truncated, corrupt or of an unsupported kind."""

    def __init__(self, kind: str, offset: int, detail: str) -> None:
        super().__init__(f"cannot decode pgoutput {kind} message at byte offset {offset}: {detail}")
        self.kind = kind
        self.offset = offset
        self.detail = detail

    def __reduce__(self) -> tuple[type[PgoutputDecodeError], tuple[str, int, str]]:
        # The default would re-call __init__ with only the formatted message,
        # which breaks pickling across processes.
        return (type(self), (self.kind, self.offset, self.detail))


@dataclass(frozen=True, slots=True)
class Begin:
    """Start of a transaction; ``final_lsn`` is the LSN of its commit record."""

    final_lsn: int
    commit_time: datetime
    xid: int


@dataclass(frozen=True, slots=True)
class Commit:
    """End of a transaction; ``end_lsn`` is the position to confirm as flushed."""

    flags: int
    commit_lsn: int
    end_lsn: int
    commit_time: datetime


@dataclass(frozen=True, slots=True)
class Column:
    """One column of a :class:`Relation`; flag bit 1 marks a replica-identity key."""

    flags: int
    name: str
    type_oid: int
    type_modifier: int


@dataclass(frozen=True, slots=True)
class Relation:
    """Schema of a published table, sent before its first change in a session.

    ``namespace`` is sent empty for ``pg_catalog``; ``replica_identity`` is the
    ``relreplident`` byte (``ord('d')``, ``'n'``, ``'f'`` or ``'i'``).
    """

    relation_id: int
    namespace: str
    name: str
    replica_identity: int
    columns: tuple[Column, ...]


@dataclass(frozen=True, slots=True)
class Insert:
    """A new row, its values in the text format of each column, in column order."""

    relation_id: int
    values: tuple[Value, ...]


@dataclass(frozen=True, slots=True)
class Ignored:
    """A well-formed message the relay has no use for, e.g. ``kind='Update'``."""

    kind: str


Message: TypeAlias = Begin | Commit | Relation | Insert | Ignored

_PG_EPOCH: Final = datetime(2000, 1, 1, tzinfo=UTC)

# Everything after the kind byte, network byte order. LSNs, xids and OIDs are
# unsigned on the server; timestamps and the type modifier are signed.
_BEGIN: Final = Struct("!QqI")
_COMMIT: Final = Struct("!BQQq")
_U8_U16: Final = Struct("!BH")
_U32: Final = Struct("!I")
_I32: Final = Struct("!i")
_U32_U8: Final = Struct("!IB")
_U32_I32: Final = Struct("!Ii")
_U16: Final = Struct("!H")

_INSERT_KIND: Final = ord("I")
_NULL: Final = ord("n")
_UNCHANGED: Final = ord("u")
_TEXT: Final = ord("t")
_BINARY: Final = ord("b")
_NEW: Final = ord("N")
_KEY: Final = ord("K")
_OLD: Final = ord("O")

_V1_KIND_NAMES: Final = {
    ord("B"): "Begin",
    ord("C"): "Commit",
    ord("O"): "Origin",
    ord("R"): "Relation",
    ord("Y"): "Type",
    ord("I"): "Insert",
    ord("U"): "Update",
    ord("D"): "Delete",
    ord("T"): "Truncate",
    ord("M"): "Message",
}

# Valid pgoutput kinds that protocol v1 never sends (see module docstring).
_LATER_KIND_NAMES: Final = {
    ord("S"): "Stream Start",
    ord("E"): "Stream Stop",
    ord("c"): "Stream Commit",
    ord("A"): "Stream Abort",
    ord("b"): "Begin Prepare",
    ord("P"): "Prepare",
    ord("K"): "Commit Prepared",
    ord("r"): "Rollback Prepared",
    ord("p"): "Stream Prepare",
}


def _short(kind: str, pos: int, need: int, end: int, what: str) -> PgoutputDecodeError:
    return PgoutputDecodeError(
        kind, pos, f"truncated {what}: need {need} bytes, {max(end - pos, 0)} left"
    )


def _check_end(kind: str, pos: int, end: int) -> None:
    if pos != end:
        raise PgoutputDecodeError(kind, pos, f"{end - pos} unexpected trailing bytes")


def _timestamp(kind: str, pos: int, micros: int) -> datetime:
    try:
        return _PG_EPOCH + timedelta(microseconds=micros)
    except OverflowError:
        raise PgoutputDecodeError(kind, pos, f"timestamp {micros} us is out of range") from None


def _cstring(payload: bytes, pos: int, kind: str, what: str) -> tuple[str, int]:
    nul = payload.find(b"\x00", pos)
    if nul < 0:
        raise PgoutputDecodeError(kind, pos, f"unterminated {what} string")
    try:
        return payload[pos:nul].decode(), nul + 1
    except UnicodeDecodeError as exc:
        raise PgoutputDecodeError(kind, pos + exc.start, f"{what} is not valid UTF-8") from None


def _tuple_data(payload: bytes, pos: int, end: int, kind: str) -> tuple[tuple[Value, ...], int]:
    """Parse TupleData at ``pos``; return the values and the offset after it."""
    if pos + 2 > end:
        raise _short(kind, pos, 2, end, "column count")
    (count,) = _U16.unpack_from(payload, pos)
    pos += 2
    values: list[Value] = []
    append = values.append
    unpack_size = _I32.unpack_from
    # One flat loop with inline bounds checks: this is the relay's hot path.
    for _ in range(count):
        if pos >= end:
            raise _short(kind, pos, 1, end, "column kind")
        column_kind = payload[pos]
        if column_kind == _TEXT:
            if pos + 5 > end:
                raise _short(kind, pos + 1, 4, end, "value length")
            (size,) = unpack_size(payload, pos + 1)
            start = pos + 5
            pos = start + size
            if size < 0 or pos > end:
                raise PgoutputDecodeError(
                    kind,
                    start - 4,
                    f"value length {size} does not fit the {end - start} bytes left",
                )
            try:
                append(payload[start:pos].decode())
            except UnicodeDecodeError as exc:
                raise PgoutputDecodeError(
                    kind, start + exc.start, "text value is not valid UTF-8"
                ) from None
        elif column_kind == _NULL:
            append(None)
            pos += 1
        elif column_kind == _UNCHANGED:
            append(UNCHANGED_TOAST)
            pos += 1
        elif column_kind == _BINARY:
            raise PgoutputDecodeError(
                kind,
                pos,
                "binary-format column value; start replication without the 'binary' option",
            )
        else:
            raise PgoutputDecodeError(kind, pos, f"unknown column kind {bytes([column_kind])!r}")
    return tuple(values), pos


def _decode_insert(payload: bytes) -> Insert:
    end = len(payload)
    if end < 6:
        raise _short("Insert", 1, 5, end, "relation id and tuple marker")
    relation_id, marker = _U32_U8.unpack_from(payload, 1)
    if marker != _NEW:
        raise PgoutputDecodeError(
            "Insert", 5, f"expected new-tuple marker b'N', got {bytes([marker])!r}"
        )
    values, pos = _tuple_data(payload, 6, end, "Insert")
    _check_end("Insert", pos, end)
    return Insert(relation_id, values)


def _decode_begin(payload: bytes) -> Begin:
    if len(payload) != 1 + _BEGIN.size:
        raise _fixed_size_error("Begin", payload, _BEGIN.size)
    final_lsn, micros, xid = _BEGIN.unpack_from(payload, 1)
    return Begin(final_lsn, _timestamp("Begin", 9, micros), xid)


def _decode_commit(payload: bytes) -> Commit:
    if len(payload) != 1 + _COMMIT.size:
        raise _fixed_size_error("Commit", payload, _COMMIT.size)
    flags, commit_lsn, end_lsn, micros = _COMMIT.unpack_from(payload, 1)
    return Commit(flags, commit_lsn, end_lsn, _timestamp("Commit", 18, micros))


def _fixed_size_error(kind: str, payload: bytes, size: int) -> PgoutputDecodeError:
    end = len(payload)
    if end < 1 + size:
        return _short(kind, 1, size, end, "body")
    return PgoutputDecodeError(kind, 1 + size, f"{end - 1 - size} unexpected trailing bytes")


def _decode_relation(payload: bytes) -> Relation:
    kind = "Relation"
    end = len(payload)
    if end < 5:
        raise _short(kind, 1, 4, end, "relation id")
    (relation_id,) = _U32.unpack_from(payload, 1)
    namespace, pos = _cstring(payload, 5, kind, "namespace")
    name, pos = _cstring(payload, pos, kind, "relation name")
    if pos + 3 > end:
        raise _short(kind, pos, 3, end, "replica identity and column count")
    replica_identity, count = _U8_U16.unpack_from(payload, pos)
    pos += 3
    columns: list[Column] = []
    for _ in range(count):
        if pos >= end:
            raise _short(kind, pos, 1, end, "column flags")
        flags = payload[pos]
        column_name, pos = _cstring(payload, pos + 1, kind, "column name")
        if pos + 8 > end:
            raise _short(kind, pos, 8, end, "column type")
        type_oid, type_modifier = _U32_I32.unpack_from(payload, pos)
        pos += 8
        columns.append(Column(flags, column_name, type_oid, type_modifier))
    _check_end(kind, pos, end)
    return Relation(relation_id, namespace, name, replica_identity, tuple(columns))


# The validators below only walk the structure of messages the relay ignores.


def _validate_origin(payload: bytes) -> None:
    end = len(payload)
    if end < 9:
        raise _short("Origin", 1, 8, end, "commit LSN")
    _, pos = _cstring(payload, 9, "Origin", "origin name")
    _check_end("Origin", pos, end)


def _validate_type(payload: bytes) -> None:
    end = len(payload)
    if end < 5:
        raise _short("Type", 1, 4, end, "type oid")
    _, pos = _cstring(payload, 5, "Type", "namespace")
    _, pos = _cstring(payload, pos, "Type", "type name")
    _check_end("Type", pos, end)


def _validate_update(payload: bytes) -> None:
    kind = "Update"
    end = len(payload)
    if end < 6:
        raise _short(kind, 1, 5, end, "relation id and tuple marker")
    _, marker = _U32_U8.unpack_from(payload, 1)
    pos = 6
    if marker in (_KEY, _OLD):
        _, pos = _tuple_data(payload, pos, end, kind)
        if pos >= end:
            raise _short(kind, pos, 1, end, "new-tuple marker")
        marker = payload[pos]
        pos += 1
    if marker != _NEW:
        raise PgoutputDecodeError(kind, pos - 1, f"unexpected tuple marker {bytes([marker])!r}")
    _, pos = _tuple_data(payload, pos, end, kind)
    _check_end(kind, pos, end)


def _validate_delete(payload: bytes) -> None:
    kind = "Delete"
    end = len(payload)
    if end < 6:
        raise _short(kind, 1, 5, end, "relation id and tuple marker")
    _, marker = _U32_U8.unpack_from(payload, 1)
    if marker not in (_KEY, _OLD):
        raise PgoutputDecodeError(
            kind, 5, f"expected tuple marker b'K' or b'O', got {bytes([marker])!r}"
        )
    _, pos = _tuple_data(payload, 6, end, kind)
    _check_end(kind, pos, end)


def _validate_truncate(payload: bytes) -> None:
    kind = "Truncate"
    end = len(payload)
    if end < 6:
        raise _short(kind, 1, 5, end, "relation count and options")
    count, _ = _U32_U8.unpack_from(payload, 1)
    need = 4 * count
    if 6 + need > end:
        raise _short(kind, 6, need, end, f"list of {count} relation ids")
    _check_end(kind, 6 + need, end)


def _validate_message(payload: bytes) -> None:
    kind = "Message"
    end = len(payload)
    if end < 10:
        raise _short(kind, 1, 9, end, "flags and LSN")
    _, pos = _cstring(payload, 10, kind, "prefix")
    if pos + 4 > end:
        raise _short(kind, pos, 4, end, "content length")
    (size,) = _I32.unpack_from(payload, pos)
    if size < 0 or pos + 4 + size > end:
        raise PgoutputDecodeError(
            kind, pos, f"content length {size} does not fit the {end - pos - 4} bytes left"
        )
    _check_end(kind, pos + 4 + size, end)


_DECODERS: Final[dict[int, Callable[[bytes], Message]]] = {
    ord("B"): _decode_begin,
    ord("C"): _decode_commit,
    ord("R"): _decode_relation,
}

_VALIDATORS: Final[dict[int, Callable[[bytes], None]]] = {
    ord("O"): _validate_origin,
    ord("Y"): _validate_type,
    ord("U"): _validate_update,
    ord("D"): _validate_delete,
    ord("T"): _validate_truncate,
    ord("M"): _validate_message,
}

_IGNORED: Final = {kind: Ignored(_V1_KIND_NAMES[kind]) for kind in _VALIDATORS}


def decode(payload: bytes) -> Message:
    """Decode one pgoutput v1 message.

    Raises :class:`PgoutputDecodeError` (naming the kind and byte offset) for an
    empty, truncated, over-long or otherwise corrupt payload, an unknown kind,
    a kind protocol v1 does not send, or a binary-format column value.
    """
    if not payload:
        raise PgoutputDecodeError("(empty)", 0, "payload has no message kind byte")
    kind = payload[0]
    # Inserts dominate the stream, so they skip the table lookups.
    if kind == _INSERT_KIND:
        return _decode_insert(payload)
    decoder = _DECODERS.get(kind)
    if decoder is not None:
        return decoder(payload)
    validator = _VALIDATORS.get(kind)
    if validator is not None:
        validator(payload)
        return _IGNORED[kind]
    later = _LATER_KIND_NAMES.get(kind)
    if later is not None:
        raise PgoutputDecodeError(
            later, 0, "not part of protocol version 1; check the slot's start options"
        )
    raise PgoutputDecodeError(f"unknown kind {bytes([kind])!r}", 0, "unknown message kind byte")


def row_as_dict(relation: Relation, insert: Insert) -> dict[str, str | None]:
    """Map column names to the text values of an Insert of ``relation``.

    Raises ValueError if the Insert belongs to another relation, does not match
    its column count, or carries an unchanged-TOAST marker (whose value the
    stream does not contain).
    """
    if insert.relation_id != relation.relation_id:
        raise ValueError(
            f"Insert for relation {insert.relation_id} does not match Relation"
            f" {relation.relation_id} ({relation.namespace}.{relation.name})"
        )
    if len(insert.values) != len(relation.columns):
        raise ValueError(
            f"Insert has {len(insert.values)} values but {relation.namespace}."
            f"{relation.name} has {len(relation.columns)} columns"
        )
    row: dict[str, str | None] = {}
    for column, value in zip(relation.columns, insert.values, strict=True):
        if value is UNCHANGED_TOAST:
            raise ValueError(
                f"column {column.name!r} is an unchanged TOAST value, not in the stream"
            )
        row[column.name] = value
    return row
