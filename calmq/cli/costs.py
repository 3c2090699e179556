"""``calmq costs``: cost per job and per accepted job, and the prompt cache's share and
savings, per workflow and tenant, of the jobs that ended within a window."""

from __future__ import annotations

import argparse
import asyncio

from calmq.cli.flags import Command, Flags, settings_for
from calmq.cli.output import Exit, add_output, emit_rows, output_format

__all__ = ["register"]

_COLUMNS = ("workflow", "tenant", "jobs", "cost_per_job_usd", "accepted",
            "cost_per_accepted_job_usd", "cached_share", "cache_saved_usd", "cost_usd")


def cmd_costs(args: argparse.Namespace) -> int:
    from calmq.cli.connect import open_store
    from calmq.data.operations import Operations
    from calmq.settings import parse_duration

    settings = settings_for(args)
    fmt = output_format(args)
    window = parse_duration(args.window or "24h")

    async def read() -> list[dict[str, object]]:
        async with open_store(settings) as store:
            rows = await Operations(store).costs(window, tenant=args.tenant or None,
                                                 workflow=args.workflow or None)
        return [r.as_dict() for r in rows]

    rows = asyncio.run(read())
    if fmt == "table":
        print(f"jobs that ended in the last {window:g} s (completed or dead-lettered; "
              "accepted: completed), each job's every attempt, review and fallback counted:")
    emit_rows(rows, fmt, _COLUMNS, empty="no job ended in the window")
    return Exit.OK


def register(command: Command, flags: Flags) -> None:
    option = flags.option
    p = command("costs", cmd_costs, "cost per job and per accepted job, and the prompt "
                "cache's share, per workflow and tenant", needs=("database_url",))
    option(p, "--window", help="the jobs that ended within it: 90m, 24h, 168h ... (default 24h)")
    option(p, "--tenant", help="only this tenant's jobs (its name)")
    option(p, "--workflow", help="only this workflow's jobs")
    option(p, "--json", action="store_true", help="JSON instead of text (same as -o json)")
    add_output(p)
