"""Size limits on what a tenant sends, measured as it will encode where it ends up.

A tenant's text reaches rows (jsonb, text) and events (Kafka records, whose size Kafka
bounds: setting kafka_max_message_bytes). A limit in characters says little about either:
``metadata`` is carried by ``job.result`` and ``job.dead_lettered`` as compact JSON with
every non-ASCII character escaped (``\\u00e9``: 6 bytes for one character, 12 for an emoji),
so 600 kB of UTF-8 text became a 1.8 MB event that Kafka refused. Each check here measures
the field the way it is stored or sent, and is run by the API at intake and by the client
library (calmq.producers.client) before a job is written, with the limits from the settings
(docs/explanation/security.md lists them).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from calmq.errors import ContractError

__all__ = [
    "CONCURRENCY_KEY_PATTERN",
    "KEEP_ERRORS",
    "MAX_CONCURRENCY_KEY",
    "MAX_METADATA_BYTES",
    "MAX_NOTE_BYTES",
    "check_concurrency_key",
    "check_metadata",
    "check_note",
    "event_json_bytes",
    "trace_parent",
]

# The defaults of settings max_metadata_bytes and max_note_bytes (also the client library's
# default, which has no settings).
MAX_METADATA_BYTES = 16 * 1024
MAX_NOTE_BYTES = 2048
# The default of setting max_job_errors: a job row keeps the errors of its last 20 failures.
KEEP_ERRORS = 20

# W3C Trace Context, version 00 (and the forward-compatible shape of later versions):
# version-traceid-parentid-flags, lowercase hex, no all-zero ids, version ff invalid.
_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?$")


# json.dumps(value, separators=(",", ":"), sort_keys=True, default=str), its encoder built
# once: every submit's metadata is measured with it (each item of a bulk submit).
_EVENT_JSON = json.JSONEncoder(separators=(",", ":"), sort_keys=True, default=str)


def event_json_bytes(value: Any) -> int:
    """Bytes of ``value`` as an event carries it: compact, sorted keys, ASCII-escaped JSON
    (calmq.events), whose UTF-8 length is its length."""
    return len(_EVENT_JSON.encode(value))


def check_metadata(metadata: Mapping[str, Any] | None, max_bytes: int) -> None:
    """Refuse ``metadata`` larger than ``max_bytes`` as the events carry it (413
    ``metadata_too_large``)."""
    if not metadata:
        return
    size = event_json_bytes(metadata)
    if size > max_bytes:
        raise ContractError(
            f"metadata is {size} bytes as the job's events carry it (compact JSON, non-ASCII "
            f"characters escaped as \\uXXXX, 6 bytes each); the limit is {max_bytes} bytes "
            "(setting max_metadata_bytes): keep large data in the input or the object store",
            code="metadata_too_large", status=413)


# A submit's concurrency_key: printable, no space at either end (it names a customer, and
# two spellings of one name would be two keys), at most 200 characters.
MAX_CONCURRENCY_KEY = 200
CONCURRENCY_KEY_PATTERN = r"^[^\s\x00-\x1f\x7f](?:[^\x00-\x1f\x7f]*[^\s\x00-\x1f\x7f])?$"


def check_concurrency_key(key: str | None) -> None:
    """Refuse a concurrency key the API refuses (422 ``invalid_body``)."""
    if key is None:
        return
    if not 0 < len(key) <= MAX_CONCURRENCY_KEY or not re.fullmatch(CONCURRENCY_KEY_PATTERN, key):
        raise ContractError(
            f"concurrency_key is 1 to {MAX_CONCURRENCY_KEY} characters with no control "
            "characters and no space at either end", code="invalid_body", status=422)


def check_note(field: str, text: str | None, max_bytes: int) -> None:
    """Refuse a free-text note (a reason, a reviewer's or redriver's name) larger than
    ``max_bytes`` as JSON text in UTF-8 (413 ``note_too_large``)."""
    if text is None:
        return
    size = len(json.dumps(text, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    if size > max_bytes:
        raise ContractError(
            f"{field} is {size} bytes as stored; the limit is {max_bytes} bytes (setting "
            "max_note_bytes)", code="note_too_large", status=413)


def trace_parent(value: str | None) -> str | None:
    """``value`` if it is a W3C ``traceparent`` (version 00 exactly, a later version by its
    prefix), else None: as the W3C rules say, an invalid one starts a new trace instead of
    failing the request, and is neither stored nor sent on to the model provider."""
    if value is None or len(value) > 512:
        return None
    found = _TRACEPARENT.match(value)
    if found is None:
        return None
    version, trace_id, parent_id, _flags, rest = found.groups()
    if version == "ff" or trace_id == "0" * 32 or parent_id == "0" * 16:
        return None
    if version == "00" and rest is not None:
        return None  # version 00 has exactly four fields
    return value[:55]  # the four fields; a later version's extra fields are not ours to keep
