"""Dead letters: list, show and redrive them, straight from the database."""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from calmq.cli.flags import Command, Flags, settings_for
from calmq.errors import ConfigError

__all__ = ["register"]


def _when(text: str | None) -> Any:
    """``--since``/``--until``: an ISO time, or a duration ago (``90m``, ``2h``)."""
    from datetime import UTC, datetime, timedelta

    from calmq.settings import parse_duration

    if not text:
        return None
    try:
        when = datetime.fromisoformat(text)
    except ValueError:
        return datetime.now(UTC) - timedelta(seconds=parse_duration(text))
    return when if when.tzinfo else when.replace(tzinfo=UTC)


def _dlq_filter(args: argparse.Namespace) -> Any:
    from calmq.deadletters import DeadLetterFilter

    return DeadLetterFilter(
        failure_class=args.failure_class, code=args.code, workflow=args.workflow,
        tenant=args.tenant, since=_when(args.since), until=_when(args.until),
        limit=int(args.limit or 100),
    )


def _jsonable(value: Any) -> Any:
    return json.loads(json.dumps(value, default=str))


def cmd_dlq(args: argparse.Namespace) -> int:
    import dataclasses
    import getpass
    import socket
    import uuid

    from calmq.data import Store
    from calmq.deadletters import DeadLetters
    from calmq.objects import open_object_store
    from calmq.workflows import load_workflows

    settings = settings_for(args)

    def ids(values: list[str]) -> list[uuid.UUID]:
        try:
            return [uuid.UUID(v) for v in values]
        except ValueError:
            raise ConfigError(f"not a job id among {values}", code="invalid_job_id") from None

    async def run() -> int:
        store = Store(settings.database_url, max_size=2)
        await store.open()
        try:
            dlq = DeadLetters(store, workflows=load_workflows(settings),
                              objects=open_object_store(settings.object_store_url))
            if args.action == "list":
                rows = await dlq.find(_dlq_filter(args))
                if args.json:
                    print(json.dumps(_jsonable([dataclasses.asdict(r) for r in rows]), indent=2))
                for r in [] if args.json else rows:
                    err = r.error or {}
                    print(f"{r.id}  {r.dead_lettered_at:%Y-%m-%d %H:%M:%S}  "
                          f"{r.tenant:<16} {r.workflow}/{r.step}  "
                          f"{err.get('class', '?')}/{err.get('code', '?')}: "
                          f"{(err.get('message') or '')[:80]}")
                if not args.json:
                    print(f"{len(rows)} dead letter(s)")
                return 0
            if args.action == "show":
                if len(args.rest) != 1:
                    raise ConfigError("usage: calmq dlq show JOB_ID", code="usage")
                job = await dlq.show(ids(args.rest)[0])
                print(json.dumps(_jsonable(job), indent=2))
                return 0
            # redrive: the given ids, or every dead letter the filters match
            where = _dlq_filter(args)
            if not args.rest and not any(v is not None for k, v in where.params().items()
                                         if k != "limit"):
                raise ConfigError("name job ids or at least one filter (--code, --since, ...); "
                                  "a bare redrive would requeue every dead letter",
                                  code="redrive_needs_target")
            targets = ids(args.rest) if args.rest else [r.id for r in await dlq.find(where)]
            if not args.reason:
                raise ConfigError("say why with --reason (it goes into the job's history)",
                                  code="redrive_needs_reason")
            who = args.by or f"{getpass.getuser()}@{socket.gethostname()}"
            outcomes = await dlq.redrive(targets, by=who, reason=args.reason,
                                         dry_run=args.dry_run,
                                         rate=float(args.rate) if args.rate else None)
            for o in outcomes:
                print(json.dumps(o.as_dict()) if args.json else
                      f"{o.job_id}  {o.outcome:<13} {o.code or ''} {o.message}".rstrip())
            counts = {k: sum(o.outcome == k for o in outcomes)
                      for k in ("redriven", "would_redrive", "skipped", "rejected")}
            if not args.json:
                print(", ".join(f"{v} {k}" for k, v in counts.items() if v) or "nothing to do")
            return 1 if counts["rejected"] else 0
        finally:
            await store.close()

    return asyncio.run(run())


def register(command: Command, flags: Flags) -> None:
    option = flags.option
    p = command("dlq", cmd_dlq, "dead letters: list, show, redrive", needs=("database_url",))
    p.add_argument("action", choices=["list", "show", "redrive"], help="what to do")
    p.add_argument("rest", nargs="*", help="job ids (show: one; redrive: none means the filter)")
    option(p, "--failure-class", help="transient, input, permission, policy, verifier, ...")
    option(p, "--code", help="the error code, e.g. malformed_output")
    option(p, "--workflow", help="the workflow's name")
    option(p, "--tenant", help="tenant name")
    option(p, "--since", help="dead-lettered at or after: ISO time or a duration ago (2h)")
    option(p, "--until", help="dead-lettered before: ISO time or a duration ago")
    option(p, "--limit", type=int, help="at most this many (default 100)")
    option(p, "--reason", help="redrive: why (recorded in the history)")
    option(p, "--by", help="redrive: who (default user@host)")
    option(p, "--rate", type=float, help="redrive: at most this many jobs per second")
    option(p, "--dry-run", action="store_true",
           help="redrive: say what would happen, write nothing")
    option(p, "--json", action="store_true", help="JSON instead of text")
