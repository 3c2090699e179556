"""`calmq submit --file` sends each line's JSON as the file has it, its key added as a member
when it has none: the API must read the very object the line re-encoded with the key would
have been (calmq.cli.backfills._chunks)."""

from __future__ import annotations

import json
from pathlib import Path

from calmq.cli.backfills import _chunks


def test_each_line_is_sent_as_the_object_it_holds_with_its_key(tmp_path: Path) -> None:
    lines = [
        '{"workflow": "summarize", "input": {"text": "caf\\u00e9 \u00e9"}}',
        '  {"workflow":"summarize","idempotency_key":"mine","input":{"text":"x"}}  ',
        "{}",
        "{ }",
        '{"idempotency_key": null, "workflow": "summarize"}',
        '{"n": 1.5e3, "big": 123456789012345678901234567890, "nested": [{"a": []}]}',
        "",
        "[1, 2]",
        '{"a": 1, "a": 2}',
    ]
    source = tmp_path / "jobs.jsonl"
    source.write_text("\n".join(lines) + "\r\n", encoding="utf-8")
    [(after, chunk, bad)] = list(_chunks(source, 1, 100, "file-x"))
    assert after == len(lines) + 1
    assert [b["line"] for b in bad] == [8]
    sent = json.loads(b'{"jobs":[' + b",".join(raw for _, raw in chunk) + b"]}")["jobs"]
    expected = []
    for number, line in enumerate(lines, start=1):
        if number in (7, 8):
            continue
        item = json.loads(line)
        item.setdefault("idempotency_key", f"file-x-{number}")
        expected.append(item)
    assert sent == expected
    assert [n for n, _ in chunk] == [1, 2, 3, 4, 5, 6, 9]


def test_chunks_split_at_the_size_and_resume_from_a_line(tmp_path: Path) -> None:
    source = tmp_path / "jobs.jsonl"
    source.write_text("".join(json.dumps({"n": n}) + "\n" for n in range(7)))
    chunks = list(_chunks(source, 3, 2, "k"))
    assert [after for after, _, _ in chunks] == [5, 7, 8]
    assert [[json.loads(raw) for _, raw in c] for _, c, _ in chunks] == [
        [{"idempotency_key": f"k-{n + 1}", "n": n} for n in pair]
        for pair in ((2, 3), (4, 5), (6,))]
