"""SQL files: numbered migrations and the named queries, loaded once."""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

__all__ = ["migrations", "queries"]

_NAME = re.compile(r"^-- name: (\w+)\s*$", re.MULTILINE)


@cache
def queries() -> dict[str, str]:
    """Every ``-- name: x`` section of the ``*.sql`` files in this folder, by name.

    One file per noun or area (jobs.sql, tenants.sql, outbox.sql, ...); a name
    defined twice is an error, so files cannot shadow each other silently.
    """
    found: dict[str, str] = {}
    for entry in sorted(resources.files(__package__).iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        parts = _NAME.split(entry.read_text("utf-8"))
        for name, body in zip(parts[1::2], parts[2::2], strict=True):
            if name in found:
                raise ValueError(f"query {name} is defined twice (again in {entry.name})")
            found[name] = body.strip()
    return found


@cache
def migrations() -> list[tuple[int, str, str]]:
    """``(version, name, sql)`` of every numbered migration, in order."""
    folder = resources.files(__package__).joinpath("migrations")
    found = []
    for entry in folder.iterdir():
        match = re.fullmatch(r"(\d{4})_(\w+)\.sql", entry.name)
        if match:
            found.append((int(match[1]), match[2], entry.read_text("utf-8")))
    return sorted(found)
