"""Dead letters: list, show, summarise and redrive them, straight from the database.

``list`` and ``show`` keep their arguments and their ``--json`` output (scripts read them).
``redrive`` of named jobs acts on those at once; ``redrive`` by filter is a bulk action
(calmq.cli.bulk): count first, confirmation, every match paged through, resumable.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from calmq.cli import bulk
from calmq.cli.flags import Command, Flags, settings_for
from calmq.cli.output import Exit, add_output, emit_rows, jsonable, output_format
from calmq.cli.times import when as _when
from calmq.errors import ConfigError, NotFound, UsageError

if TYPE_CHECKING:
    from calmq.data import Store
    from calmq.deadletters import DeadLetterFilter, DeadLetters
    from calmq.settings import Settings

__all__ = ["register"]

_FILTERS = ("failure_class", "code", "workflow", "tenant", "since", "until")
_PAGE = 500  # a bulk redrive's page when --limit is not given


def _filter(values: dict[str, Any], limit: int) -> DeadLetterFilter:
    from calmq.deadletters import DeadLetterFilter
    from calmq.errors import ContractError

    try:
        return DeadLetterFilter(
            failure_class=values.get("failure_class"), code=values.get("code"),
            workflow=values.get("workflow"), tenant=values.get("tenant"),
            since=_when(values.get("since")), until=_when(values.get("until")), limit=limit)
    except ContractError as exc:
        raise UsageError(exc.message, code=exc.code) from None


def _flag_filters(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in _FILTERS if getattr(args, k) is not None}


def _ids(values: list[str]) -> list[uuid.UUID]:
    try:
        return [uuid.UUID(v) for v in values]
    except ValueError:
        raise ConfigError(f"not a job id among {values}", code="invalid_job_id") from None


def _dead_letters(store: Store, settings: Settings) -> DeadLetters:
    from calmq.deadletters import DeadLetters
    from calmq.objects import open_object_store
    from calmq.workflows import load_workflows

    return DeadLetters(store, workflows=load_workflows(settings),
                       objects=open_object_store(settings.object_store_url),
                       children_in_flight=settings.children_in_flight_max)


def _who(args: argparse.Namespace) -> str:
    import getpass
    import socket

    return str(args.by or f"{getpass.getuser()}@{socket.gethostname()}")


class _Redrive:
    """The bulk redrive of calmq.cli.bulk: the frozen filter's dead letters, oldest first."""

    def __init__(self, dlq: DeadLetters, where: DeadLetterFilter, *, by: str, reason: str,
                 dry_run: bool) -> None:
        self.dlq, self.where, self.by, self.reason, self.dry_run = (
            dlq, where, by, reason, dry_run)

    async def count(self, after: bulk.Key | None) -> int:
        return await self.dlq.count(self.where, after=after)

    async def page(self, after: bulk.Key | None, size: int
                   ) -> list[tuple[bulk.Key, uuid.UUID]]:
        rows = await self.dlq.find(dataclasses.replace(self.where, limit=size), after=after)
        return [((r.dead_lettered_at, r.id), r.id) for r in rows]

    async def act(self, job_id: uuid.UUID) -> bulk.Outcome:
        try:
            [o] = await self.dlq.redrive([job_id], by=self.by, reason=self.reason,
                                         dry_run=self.dry_run)
        except NotFound:  # deleted (retention, DELETE /v1/jobs) since the page was read
            return bulk.Outcome(job_id, "skipped", "skipped", "not_found",
                                "the job no longer exists")
        kind: bulk.Kind = ("failed" if o.outcome == "rejected" else
                           "skipped" if o.outcome == "skipped" else "done")
        return bulk.Outcome(job_id, kind, o.outcome, o.code, o.message, {"round": o.round})


def _describe(values: dict[str, Any]) -> str:
    parts = [f"{k.replace('_', '-')}={v}" for k, v in values.items()
             if k in _FILTERS and k != "until" and v is not None]
    return ", ".join([f"dead-lettered before {values['until']}", *parts])


def _redrive(args: argparse.Namespace, settings: Settings) -> int:
    fmt = output_format(args)
    rate = float(args.rate) if args.rate else None
    if args.resume and (args.rest or _flag_filters(args)):
        raise UsageError("--resume takes the filter from its checkpoint: give no job ids or "
                         "filters with it", code="resume_with_filter")
    if not args.resume and not args.rest and not _flag_filters(args):
        raise ConfigError("name job ids or at least one filter (--code, --since, ...); "
                          "a bare redrive would requeue every dead letter",
                          code="redrive_needs_target")
    if not args.resume and not args.reason:
        raise ConfigError("say why with --reason (it goes into the job's history)",
                          code="redrive_needs_reason")
    if args.rest:
        return _redrive_named(args, settings, _ids(args.rest), rate=rate)

    # The filter is frozen here: --until pinned to now (or earlier), so a job that dies
    # during the run, or before a resume, is not redriven by this run.
    values = _flag_filters(args)
    _filter(values, int(args.limit or _PAGE))  # refuse a bad filter or page before counting
    until = bulk.pinned(_when(values.get("until")), datetime.now(UTC))
    params = {**values, "until": until.isoformat(), "since": _iso(_when(values.get("since"))),
              "reason": args.reason, "by": _who(args)}

    def make(store: Store, p: dict[str, Any]) -> bulk.Action:
        # Flags given with --resume may change who and why; the filter never changes.
        return _Redrive(_dead_letters(store, settings), _filter(p, 1),
                        by=args.by or p["by"], reason=args.reason or p["reason"],
                        dry_run=bool(args.dry_run))

    job = bulk.Bulk(command="dlq redrive", noun="dead letters", verb="redrive",
                    done_word="redriven", params=params, describe=_describe(params),
                    make=make, resumable=bulk.FrozenFilter(
                        keys=frozenset({*_FILTERS, "reason", "by"}),
                        filters=frozenset(_FILTERS), pinned="until",
                        parse=lambda p: _filter(p, 1)))
    if args.resume:
        state = bulk.Checkpoint.load(Path(args.resume), job.command)
        job = dataclasses.replace(job, describe=_describe(state.params))
    return bulk.run_bulk(job, settings, fmt=fmt, yes=bool(args.yes), dry_run=bool(args.dry_run),
                         rate=rate, page_size=int(args.limit or _PAGE),
                         resume=Path(args.resume) if args.resume else None,
                         checkpoint=Path(args.checkpoint) if args.checkpoint else None)


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _redrive_named(args: argparse.Namespace, settings: Settings, targets: list[uuid.UUID],
                   *, rate: float | None) -> int:
    """Jobs named by id: the person chose each one, so no count and no question."""
    from calmq.cli.connect import open_store

    async def run() -> list[bulk.Outcome]:
        async with open_store(settings) as store:
            action = _Redrive(_dead_letters(store, settings), _filter({}, 1), by=_who(args),
                              reason=args.reason, dry_run=bool(args.dry_run))
            return await bulk.run_each(targets, action.act,
                                       rate=None if args.dry_run else rate)

    outcomes = asyncio.run(run())
    return bulk.report(outcomes, output_format(args),
                       done_word="would_redrive" if args.dry_run else "redriven")


def cmd_dlq(args: argparse.Namespace) -> int:
    from calmq.cli.connect import open_store

    settings = settings_for(args)
    if args.action == "redrive":
        return _redrive(args, settings)
    fmt = output_format(args)

    async def run() -> int:
        async with open_store(settings) as store:
            dlq = _dead_letters(store, settings)
            if args.action == "list":
                rows = await dlq.find(_filter(_flag_filters(args), int(args.limit or 100)))
                if fmt != "table":
                    emit_rows([dataclasses.asdict(r) for r in rows], fmt, ())
                    return Exit.OK
                for r in rows:
                    err = r.error or {}
                    print(f"{r.id}  {r.dead_lettered_at:%Y-%m-%d %H:%M:%S}  "
                          f"{r.tenant:<16} {r.workflow}/{r.step}  "
                          f"{err.get('class', '?')}/{err.get('code', '?')}: "
                          f"{(err.get('message') or '')[:80]}")
                print(f"{len(rows)} dead letter(s)")
                return Exit.OK
            if args.action == "summary":
                groups = await dlq.summary(_filter(_flag_filters(args), 1))
                emit_rows([{**dataclasses.asdict(g), "oldest": g.oldest.isoformat(),
                            "newest": g.newest.isoformat()} for g in groups], fmt,
                          ("count", "workflow", "step", "failure_class", "code", "oldest",
                           "newest"), empty="no dead letters match")
                if fmt == "table" and groups:
                    print(f"{sum(g.count for g in groups)} dead letter(s) in "
                          f"{len(groups)} group(s)")
                return Exit.OK
            # show: the whole record; JSON unless asked otherwise (scripts read it)
            if len(args.rest) != 1:
                raise UsageError("usage: calmq dlq show JOB_ID", code="usage")
            job = await dlq.show(_ids(args.rest)[0])
            out = args.output or "json"
            print(json.dumps(jsonable(job), indent=None if out == "jsonl" else 2))
            return Exit.OK

    return asyncio.run(run())


def register(command: Command, flags: Flags) -> None:
    option = flags.option
    p = command("dlq", cmd_dlq, "dead letters: list, show, summary, redrive",
                needs=("database_url",))
    p.add_argument("action", choices=["list", "show", "summary", "redrive"],
                   help="list them; show one (JSON); summary: counts by workflow/step, "
                        "failure class and code; redrive named ones or every match of the "
                        "filters (a bulk action: count, confirm, progress, resumable)")
    p.add_argument("rest", nargs="*", help="job ids (show: one; redrive: none means the filter)")
    option(p, "--failure-class", help="transient, input, permission, policy, verifier, ...")
    option(p, "--code", help="the error code, e.g. malformed_output")
    option(p, "--workflow", help="the workflow's name")
    option(p, "--tenant", help="tenant name")
    option(p, "--since", help="dead-lettered at or after: ISO time or a duration ago (2h)")
    option(p, "--until", help="dead-lettered before: ISO time or a duration ago; a bulk "
                              "redrive pins it to its start time at the latest")
    option(p, "--limit", type=int,
           help="list: at most this many (default 100); redrive by filter: the page size "
                f"(default {_PAGE}), every match is redriven whatever it is")
    option(p, "--reason", help="redrive: why (recorded in the history)")
    option(p, "--by", help="redrive: who (default user@host)")
    option(p, "--rate", type=float, help="redrive: at most this many jobs per second")
    option(p, "--dry-run", action="store_true",
           help="redrive: say what would happen, write nothing")
    option(p, "--yes", "-y", action="store_true",
           help="redrive by filter: go on without asking (required when not on a terminal)")
    option(p, "--checkpoint", help="redrive by filter: write the resume checkpoint here "
                                   "(default: a new file under ~/.local/state/calmq/bulk)")
    option(p, "--resume", help="redrive: continue the interrupted run of this checkpoint file "
                               "(its filter and reason; no filters or ids with it)")
    option(p, "--json", action="store_true", help="JSON instead of text (same as -o json)")
    add_output(p)
