"""``calmq migrate``: bring the database to the schema this calmq needs, and nothing else.

It needs only the database (no Kafka, no registry), so it runs as a Kubernetes Job (or a
Helm pre-upgrade hook) before the new pods roll out. The services never migrate on start:
a pod that changed the schema as it came up would do so while the previous release still
serves, and N replicas would queue on the lock on every restart. `calmq dev up` migrates
its own database, under the same advisory lock as this command.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from calmq.cli.flags import Command, Flags, settings_for
from calmq.cli.output import Exit, emit_rows, output_format

__all__ = ["register"]


def cmd_migrate(args: argparse.Namespace) -> int:
    import psycopg

    from calmq.cli.connect import CONNECT_TIMEOUT_SECONDS, database_address, unreachable
    from calmq.data import migrations

    settings = settings_for(args)
    url = settings.effective_migrate_database_url  # DDL rights: its own role, if set
    fmt = output_format(args)
    address = database_address(url)

    def waiting() -> None:
        print(f"another process is migrating {address}; waiting for it to finish",
              file=sys.stderr)

    try:
        if args.dry_run:
            todo = migrations.pending(url, connect_timeout=CONNECT_TIMEOUT_SECONDS)
        else:
            todo = migrations.apply_pending(url, connect_timeout=CONNECT_TIMEOUT_SECONDS,
                                            on_wait=waiting)
        newer = migrations.unknown(url, connect_timeout=CONNECT_TIMEOUT_SECONDS)
    except psycopg.OperationalError as exc:
        raise unreachable(url, exc) from exc
    if newer:
        # Not an error: a rolled-back release runs against a schema that only added to its
        # own, so the services keep working; the person deploying should still know.
        print(f"note: {address} has migration(s) {', '.join(f'{v:04d}' for v in newer)} that "
              "this calmq does not ship: a newer release applied them", file=sys.stderr)
    status = "pending" if args.dry_run else "applied"
    rows: list[dict[str, Any]] = [
        {"version": m.version, "name": m.name, "file": m.file, "status": status} for m in todo
    ]
    if fmt != "table":
        emit_rows(rows, fmt, ())
        return Exit.OK
    if not rows:
        print(f"database is up to date ({address})")
        return Exit.OK
    emit_rows(rows, fmt, ("version", "file", "status"))
    if args.dry_run:
        print(f"would apply {len(rows)} migration(s) to {address}; dry run, nothing written")
    else:
        print(f"applied {len(rows)} migration(s) to {address}")
    return Exit.OK


def register(command: Command, flags: Flags) -> None:
    p = command("migrate", cmd_migrate,
                "apply the pending database migrations (under an advisory lock; idempotent)",
                needs=("database_url",))
    flags.option(p, "--dry-run", action="store_true",
                 help="list the migrations that would be applied and write nothing")
    # output.add_output's flag, made with flags.option so that CALMQ_OUTPUT is an option's
    # variable (a Job may set it) rather than an unknown setting.
    flags.option(p, "-o", "--output", choices=["table", "json", "jsonl"], default=None,
                 help="output format (default table): table for people, json one array of "
                      "migrations, jsonl one migration per line")
    p.set_defaults(output_default="table")
