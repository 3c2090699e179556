"""SQL files: numbered migrations and the named queries, loaded once.

A query may use a *fragment*: a ``-- fragment: x`` section of any ``.sql`` file, written
``{{x}}`` where it goes. The job row (``job_row``: the columns calmq.data.jobs.Job is read
from) is one: the eight statements that return jobs (claim, reap, poison, sweep, the three
hold releases and the batch lane's settle) name it instead of spelling the columns out, so
a new job column is added to one list, not eight.
"""

from __future__ import annotations

import re
from functools import cache
from importlib import resources

__all__ = ["fragments", "migrations", "queries", "sources"]

_SECTION = re.compile(r"^-- (name|fragment): (\w+)\s*$", re.MULTILINE)
_USE = re.compile(r"\{\{(\w+)\}\}")


@cache
def sources() -> dict[str, tuple[str, str]]:
    """Every section as written, by name: ``(kind, text)``, kind ``name`` (a query) or
    ``fragment``. A name defined twice, in one file or two, is an error, so files cannot
    shadow each other silently."""
    found: dict[str, tuple[str, str]] = {}
    for entry in sorted(resources.files(__package__).iterdir(), key=lambda e: e.name):
        if not entry.name.endswith(".sql"):
            continue
        parts = _SECTION.split(entry.read_text("utf-8"))
        for kind, name, body in zip(parts[1::3], parts[2::3], parts[3::3], strict=True):
            if name in found:
                raise ValueError(f"query {name} is defined twice (again in {entry.name})")
            found[name] = (kind, body.strip())
    return found


@cache
def fragments() -> dict[str, str]:
    """Every ``-- fragment:`` section by name, its comment lines left out."""
    return {name: "\n".join(line for line in text.splitlines()
                            if not line.lstrip().startswith("--")).strip()
            for name, (kind, text) in sources().items() if kind == "fragment"}


@cache
def queries() -> dict[str, str]:
    """Every ``-- name: x`` section of the ``*.sql`` files in this folder, by name, with its
    fragments filled in.

    One file per noun or area (jobs.sql, tenants.sql, outbox.sql, ...).
    """
    known = fragments()

    def fill(match: re.Match[str]) -> str:
        if match[1] not in known:
            raise ValueError(f"no SQL fragment named {match[1]}")
        return known[match[1]]

    return {name: _USE.sub(fill, text)
            for name, (kind, text) in sources().items() if kind == "name"}


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
