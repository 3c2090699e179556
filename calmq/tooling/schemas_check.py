"""Compatibility of the schema versions in schemas/: each new version must read records
written with the one before it (the registry's BACKWARD rule), and each old version must read
records written with the one after it (FORWARD: a consumer built against the previous schema
keeps decoding what calmq writes now)."""

from __future__ import annotations

import io
import itertools
from typing import Any

import fastavro

from calmq.codec import SchemaStore

__all__ = ["check_backward", "check_forward", "sample_record"]


def sample_record(schema: Any) -> Any:
    """A record that exercises every field of ``schema`` (non-null branch of unions)."""
    if isinstance(schema, list):
        branches = [b for b in schema if b != "null"]
        return sample_record(branches[0]) if branches else None
    if isinstance(schema, str):
        return {"string": "x", "int": 1, "long": 2, "float": 1.5, "double": 2.5,
                "boolean": True, "bytes": b"b", "null": None}.get(schema, "x")
    kind = schema["type"]
    if kind == "record":
        return {f["name"]: sample_record(f["type"]) for f in schema["fields"]}
    if kind == "enum":
        return schema["symbols"][0]
    if kind == "array":
        return [sample_record(schema["items"])]
    if kind == "map":
        return {"k": sample_record(schema["values"])}
    if kind == "fixed":
        return b"\0" * schema["size"]
    if schema.get("logicalType") == "uuid":
        return "00000000-0000-4000-8000-000000000000"
    return sample_record(kind)


def _reads(writer: Any, reader: Any) -> Exception | None:
    record = sample_record(writer)
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, writer, record)
    buf.seek(0)
    try:
        fastavro.schemaless_reader(buf, writer, reader)
    except Exception as exc:  # noqa: BLE001 - any failure is the finding
        return exc
    return None


def check_backward(store: SchemaStore) -> list[str]:
    """Each version reads records written with the one before it."""
    problems = []
    for event_type, versions in store.versions.items():
        for old, new in itertools.pairwise(versions):
            if (exc := _reads(old.parsed, new.parsed)) is not None:
                problems.append(f"{event_type} v{new.version} cannot read v{old.version}: {exc}")
    return problems


def check_forward(store: SchemaStore) -> list[str]:
    """Each version reads records written with the one after it (old consumers keep working)."""
    problems = []
    for event_type, versions in store.versions.items():
        for old, new in itertools.pairwise(versions):
            if (exc := _reads(new.parsed, old.parsed)) is not None:
                problems.append(f"{event_type} v{old.version} cannot read v{new.version}: {exc}")
    return problems
