"""A bulk submit walks its items for text PostgreSQL cannot store only when the raw body may
hold some (producers.routes.bulk.surely_storable): whatever body check_storable would
refuse an item of is never taken as surely storable."""

from __future__ import annotations

import json
import re

import pytest

from calmq.errors import ContractError
from calmq.producers.parsing import check_storable, parse_json
from calmq.producers.routes.bulk import surely_storable

UNSTORABLE = ["a\x00b", "\ud800", "x\udfff", "\udbff\u0041", "\U0001f600\ud83d"]
STORABLE = ["plain", "caf\u00e9", "\ud7ff\ue000", "\U0001f600", "back\\u0000slash", ""]


def _bodies(text: str) -> list[bytes]:
    item = {"workflow": "summarize", "input": {"text": text}, text: 1}
    body = {"jobs": [item]}
    return [json.dumps(body).encode(),  # escaped (ASCII)
            json.dumps(body, ensure_ascii=False).encode("utf-8", "surrogatepass"),
            re.sub(r"\\u([0-9a-f]{4})", lambda m: "\\u" + m[1].upper(),
                   json.dumps(body)).encode(),  # escapes in capitals
            json.dumps(body).encode("utf-16")]


@pytest.mark.parametrize("text", UNSTORABLE)
def test_a_body_with_unstorable_text_is_never_surely_storable(text: str) -> None:
    for raw in _bodies(text):
        parsed = parse_json(raw)
        with pytest.raises(ContractError):
            check_storable(parsed)
        assert not surely_storable(raw), raw


@pytest.mark.parametrize("text", STORABLE)
def test_a_plain_utf8_body_is_surely_storable(text: str) -> None:
    raw = json.dumps({"jobs": [{"input": {"text": text}}]}, ensure_ascii=False).encode()
    check_storable(parse_json(raw))
    if "\\u0000" not in json.dumps(text):
        assert surely_storable(raw)
