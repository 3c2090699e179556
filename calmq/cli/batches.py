"""Provider batches of the batch lane: list them, show one with its jobs, cancel one."""

from __future__ import annotations

import argparse
import asyncio

from calmq.cli.flags import Command, Flags, settings_for
from calmq.cli.output import Exit, add_output, emit_one, emit_rows, output_format
from calmq.errors import NotFound, UsageError

__all__ = ["register"]

_STATES = ("creating", "submitted", "collected", "abandoned")


def cmd_batches(args: argparse.Namespace) -> int:
    from calmq.cli.connect import open_store

    settings = settings_for(args)
    fmt = output_format(args)
    if args.action in ("show", "cancel") and len(args.rest) != 1:
        raise UsageError(f"batches {args.action} takes one batch: calmq's key or the "
                         "provider's id", code="invalid_arguments")

    async def run() -> int:
        async with open_store(settings) as store:
            if args.action == "list":
                rows = await store.batches.overview(state=args.state,
                                                    limit=int(args.limit or 50))
                emit_rows([r.as_dict() for r in rows], fmt,
                          ("key", "provider", "provider_id", "state", "provider_status",
                           "request_count", "created_at", "cost_usd", "savings_usd"),
                          empty="no provider batches")
                return Exit.OK
            found = await store.batches.find(args.rest[0])
            if found is None:
                raise NotFound(f"no provider batch {args.rest[0]}", code="batch_not_found")
            if args.action == "cancel":
                if not await store.batches.request_cancel(found.key):
                    raise UsageError(f"batch {args.rest[0]} is {found.state}: nothing to "
                                     "cancel", code="batch_closed")
                print(f"cancel requested for batch {found.provider_id or found.key}: its poller "
                      "cancels it at the provider; unfinished jobs go into a new batch")
                return Exit.OK
            members = await store.batches.members(found.key, limit=int(args.limit or 1000))
            emit_one({**found.as_dict(), "jobs": [m.as_dict() for m in members]}, fmt)
            return Exit.OK

    return asyncio.run(run())




def register(command: Command, flags: Flags) -> None:
    option = flags.option
    p = command("batches", cmd_batches, "provider batches of the batch lane: list, show, cancel",
                needs=("database_url",))
    p.add_argument("action", choices=["list", "show", "cancel"],
                   help="list them (newest first); show one with its jobs; cancel one")
    p.add_argument("rest", nargs="*", help="show/cancel: calmq's batch key or the provider's id")
    option(p, "--state", choices=list(_STATES), help="list: only batches in this state")
    option(p, "--limit", type=int, help="list: at most this many (default 50); show: jobs")
    option(p, "--json", action="store_true", help="JSON instead of text (same as -o json)")
    add_output(p)
