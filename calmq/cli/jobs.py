"""Jobs: list, show, follow and cancel any tenant's jobs from the database; submit and status
through the API.

``jobs`` reads PostgreSQL directly, like ``dlq``: an operator sees every tenant's jobs
without an API key, with the API's filters and the API's JSON shapes (producers.views), so
a script reads ``calmq jobs ... -o json`` and ``GET /v1/jobs`` alike. ``jobs cancel`` by
filter is a bulk action (calmq.cli.bulk). ``submit`` and ``status`` stay API clients: they
are what a tenant's own scripts call.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import dataclasses
import json
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from calmq.cli import bulk, reruns
from calmq.cli.flags import Command, Flags, json_object, key_values, settings_for
from calmq.cli.output import Exit, Format, add_output, emit_one, emit_rows, jsonable, output_format
from calmq.cli.times import when as _when
from calmq.errors import ConfigError, NotFound, UsageError
from calmq.jobs import Priority

if TYPE_CHECKING:
    from calmq.data import JobDetail, JobSearch, Store, TenantJob

__all__ = ["register"]

_CANCELLABLE = ("queued", "running", "retrying", "awaiting_review")  # not calmq.jobs.TERMINAL
_LIST_COLUMNS = ("job_id", "tenant", "workflow", "status", "step", "attempt", "created_at",
                 "updated_at")
_PAGE = 500
_FOLLOW_POLL_SECONDS = 0.5


# -- through the API ------------------------------------------------------------------------

def _http(method: str, url: str, key: str, body: dict[str, Any] | None = None) -> tuple[int, Any]:
    import urllib.error
    import urllib.request

    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={  # noqa: S310
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - our own API
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read() or b"{}")
    except urllib.error.URLError as exc:
        raise ConfigError(f"the API at {url} is not reachable ({exc.reason}): check "
                          "CALMQ_API_URL, or start the local stack with `calmq dev up`",
                          code="api_unreachable") from None



def cmd_submit(args: argparse.Namespace) -> int:
    settings = settings_for(args)
    if not args.api_key:
        raise ConfigError("pass --api-key or set CALMQ_API_KEY", code="missing_api_key")
    if args.file:
        from calmq.cli.backfills import run_file

        return run_file(api_url=settings.api_url, api_key=args.api_key, path=Path(args.file),
                        chunk_size=int(args.chunk_size), max_chunks=args.max_chunks,
                        checkpoint=Path(args.checkpoint) if args.checkpoint else None,
                        fmt=output_format(args), concurrency=int(args.in_flight),
                        state_dir=settings.cli_state_dir)
    data = json_object(args.input) if args.input else {"text": args.text or "", "mode": args.mode}
    status, body = _http("POST", f"{settings.api_url}/v1/jobs", args.api_key, {
        "workflow": args.workflow, "input": {k: v for k, v in data.items() if v is not None},
        "priority": args.priority})
    print(json.dumps(body, indent=2))
    return 0 if status == 202 else 1


def cmd_status(args: argparse.Namespace) -> int:
    settings = settings_for(args)
    if not args.api_key:
        raise ConfigError("pass --api-key or set CALMQ_API_KEY", code="missing_api_key")
    status, body = _http("GET", f"{settings.api_url}/v1/jobs/{args.job_id}", args.api_key)
    print(json.dumps(body, indent=2))
    return 0 if status == 200 else 1


# -- straight from the database ---------------------------------------------------------------

def _job_id(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise UsageError(f"{text!r} is not a job id", code="invalid_job_id") from None


def _statuses(values: str | list[str] | None) -> list[str] | None:
    """``--status`` (a comma list), or the list a checkpoint saved."""
    from calmq.jobs import Status

    if isinstance(values, str):
        values = [values]
    found = [s.strip() for v in values or [] for s in v.split(",") if s.strip()] or None
    valid = {s.value for s in Status}
    if found and not set(found) <= valid:
        raise UsageError(f"--status is one of {', '.join(sorted(valid))}",
                         code="invalid_status")
    return found


def _encode_cursor(at: datetime, ident: uuid.UUID) -> str:
    return base64.urlsafe_b64encode(f"{at.isoformat()}|{ident}".encode()).decode().rstrip("=")


def _decode_cursor(value: str | None) -> tuple[datetime | None, uuid.UUID | None]:
    if not value:
        return None, None
    try:
        at, _, ident = base64.urlsafe_b64decode(value.encode() + b"==").decode().partition("|")
        return datetime.fromisoformat(at), uuid.UUID(ident)
    except (ValueError, binascii.Error, UnicodeDecodeError):
        raise UsageError("--cursor is not one this command printed",
                         code="invalid_cursor") from None


def _search(values: dict[str, Any], limit: int, *, cancellable: bool = False) -> JobSearch:
    from calmq.data import JobSearch

    statuses = _statuses(values.get("status"))
    if cancellable:  # only a job that is not terminal can be cancelled
        statuses = [s for s in statuses or _CANCELLABLE if s in _CANCELLABLE]
        if not statuses:
            raise UsageError("none of these statuses can be cancelled: terminal jobs stay",
                             code="nothing_cancellable")
    return JobSearch(limit=limit, tenant=values.get("tenant"), statuses=statuses,
                     workflow=values.get("workflow"),
                     created_after=_when(values.get("created_after")),
                     created_before=_when(values.get("created_before")))


_CANCEL_FILTERS = ("status", "workflow", "tenant", "created_after", "created_before")


def _flag_filters(args: argparse.Namespace) -> dict[str, Any]:
    return {k: getattr(args, k) for k in _CANCEL_FILTERS if getattr(args, k, None)}


def _row(job: TenantJob) -> dict[str, Any]:
    """The API's JobSummary, and whose job it is (an operator sees every tenant's)."""
    from calmq.producers.views import job_summary

    return {**job_summary(job), "tenant": job.tenant}


async def _owned(store: Store, job_id: uuid.UUID) -> uuid.UUID:
    tenant_id = await store.jobs.tenant_of(job_id)
    if tenant_id is None:
        raise NotFound(f"no job {job_id}: check the id (`calmq jobs list` finds jobs)")
    return tenant_id


async def _detail(store: Store, job_id: uuid.UUID) -> JobDetail:
    detail = await store.jobs.view(await _owned(store, job_id), job_id)
    if detail is None:  # deleted between the two reads
        raise NotFound(f"no job {job_id}")
    return detail


def _iso(value: Any) -> Any:
    """Every datetime inside as ISO 8601, as the API writes times (format_time)."""
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, dict):
        return {k: _iso(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_iso(v) for v in value]
    return value


_STORY_FIELDS = ("tenant", "tenant_id", "priority", "pool", "workflow_version", "max_attempts",
                 "input", "input_ref", "callback_url", "deadline_at", "trace_parent", "errors",
                 "attempts", "last_output")


async def _story(store: Store, job_id: uuid.UUID) -> dict[str, Any]:
    """GET /v1/jobs/{id}'s JobView, and what only an operator sees: whose, where it ran,
    every attempt of every redrive round, every error, the last output and the trace id."""
    from calmq.deadletters import DeadLetters
    from calmq.producers.views import job_view

    view = job_view(await _detail(store, job_id))
    record = await DeadLetters(store).show(job_id)
    extra = {k: _iso(record.get(k)) for k in _STORY_FIELDS}
    parent = record.get("trace_parent") or ""
    # W3C traceparent: version-traceid-spanid-flags; the trace id finds the job's spans.
    parts = parent.split("-")
    extra["trace_id"] = parts[1] if len(parts) == 4 else None
    story: dict[str, Any] = jsonable({**view, **extra})
    return story


def _show_table(story: dict[str, Any]) -> None:
    err = story.get("error") or {}
    usage = story["usage"]
    emit_one({
        "job": story["job_id"], "tenant": story["tenant"],
        "workflow": f"{story['workflow']} v{story['workflow_version']} "
                    f"(pool {story['pool']}, priority {story['priority']})",
        "status": f"{story['status']} at step {story['step']}, attempt {story['attempt']}"
                  f"/{story['max_attempts']}",
        "waiting": story.get("waiting_reason"),
        "created": story["created_at"], "updated": story["updated_at"],
        "trace id": story["trace_id"],
        "usage": f"{usage['input_tokens']} in / {usage['output_tokens']} out tokens, "
                 f"${usage['cost_usd']:.6f}",
        "error": f"{err.get('class')}/{err.get('code')}: {err.get('message')}" if err else None,
        "artifact": (story.get("artifact") or {}).get("uri"),
    }, "table")
    print("\nattempts")
    emit_rows([{**a, "error": (a.get("error_code") or a.get("error_class"))}
               for a in story["attempts"]], "table",
              ("round", "step", "attempt", "outcome", "worker", "started_at", "finished_at",
               "error"), empty="  none yet")
    print("\ntimeline")
    start = datetime.fromisoformat(story["created_at"])
    for e in story["events"]:
        offset = (datetime.fromisoformat(e["at"]) - start).total_seconds()
        detail = json.dumps(e["detail"], separators=(",", ":")) if e["detail"] else ""
        since = f"+{offset:.3f}s"
        print(f"  {since:>11}  {e['type']:<24} attempt {e['attempt']}  {detail}".rstrip())


def cmd_jobs(args: argparse.Namespace) -> int:
    settings = settings_for(args)
    action = args.jobs_action
    if action == "cancel":
        return _cancel(args, settings)
    if action == "rerun":
        from calmq.cli.reruns import cmd_rerun

        return cmd_rerun(args, settings)
    fmt = output_format(args)
    from calmq.cli.connect import open_store

    # A flag the command cannot use is a usage error even when the database is down.
    if action == "list":
        _search(_flag_filters(args), 1)
        _decode_cursor(args.cursor)
    else:
        _job_id(args.job_id)

    async def run() -> int:
        async with open_store(settings) as store:
            if action == "list":
                return await _list(store, args, fmt)
            if action == "show":
                story = await _story(store, _job_id(args.job_id))
                if fmt == "table":
                    _show_table(story)
                else:
                    emit_one(story, fmt)
                return Exit.OK
            return await _events(store, _job_id(args.job_id), fmt, follow=bool(args.follow))

    return asyncio.run(run())



async def _list(store: Store, args: argparse.Namespace, fmt: Format) -> int:
    size = int(args.limit or 50)
    if not 1 <= size <= 1000:
        raise UsageError("--limit is between 1 and 1000 (the API's bounds)", code="invalid_limit")
    cursor_at, cursor_id = _decode_cursor(args.cursor)
    which = dataclasses.replace(_search(_flag_filters(args), size + 1), cursor_at=cursor_at,
                                cursor_id=cursor_id, metadata=key_values(args.metadata))
    rows = await store.jobs.search(which)
    page, more = rows[:size], len(rows) > size
    next_cursor = _encode_cursor(page[-1].created_at, page[-1].id) if more else None
    jobs = [_row(r) for r in page]
    if fmt == "json":  # the API's JobPage
        emit_one({"jobs": jobs, "next_cursor": next_cursor}, "json")
        return Exit.OK
    emit_rows(jobs, fmt, _LIST_COLUMNS, empty="no jobs match")
    if next_cursor and fmt == "table":
        print(f"more: --cursor {next_cursor}")
    return Exit.OK


async def _events(store: Store, job_id: uuid.UUID, fmt: Format, *, follow: bool) -> int:
    """The history (the SSE stream's data, one object per event); with follow, new events
    as they are written until the job ends."""
    from calmq.jobs import TERMINAL
    from calmq.producers.views import event_view

    tenant_id = await _owned(store, job_id)
    after, everything = 0, []
    while True:
        status, rows = await store.jobs.status_and_events(tenant_id, job_id, after)
        if status is None:
            raise NotFound(f"no job {job_id}")
        for r in rows:
            event = {"job_id": str(job_id), **event_view(r)}
            after = r.id
            if fmt == "json":
                everything.append(event)
            elif fmt == "jsonl":
                print(json.dumps(event), flush=True)
            else:
                detail = json.dumps(r.detail, separators=(",", ":")) if r.detail else ""
                print(f"{event['at']}  {r.type:<24} attempt {r.attempt}  {detail}".rstrip(),
                      flush=True)
        if not follow or status in TERMINAL:
            break
        await asyncio.sleep(_FOLLOW_POLL_SECONDS)  # polling interval of --follow
    if fmt == "json":
        emit_rows(everything, "json", ())
    return Exit.OK


# -- cancel ---------------------------------------------------------------------------------

class _Cancel:
    """The bulk cancel of calmq.cli.bulk: the frozen filter's jobs, newest first."""

    def __init__(self, store: Store, which: JobSearch, *, dry_run: bool) -> None:
        self.store, self.which, self.dry_run = store, which, dry_run
        self._tenant: dict[uuid.UUID, uuid.UUID] = {}  # from the page: no read per job

    async def count(self, after: bulk.Key | None) -> int:
        return await self.store.jobs.count(self._after(after, self.which.limit))

    def _after(self, after: bulk.Key | None, size: int) -> JobSearch:
        at, ident = after if after is not None else (None, None)
        return dataclasses.replace(self.which, cursor_at=at, cursor_id=ident, limit=size)

    async def page(self, after: bulk.Key | None, size: int
                   ) -> list[tuple[bulk.Key, uuid.UUID]]:
        rows = await self.store.jobs.search(self._after(after, size))
        self._tenant = {r.id: r.tenant_id for r in rows}
        return [((r.created_at, r.id), r.id) for r in rows]

    async def act(self, job_id: uuid.UUID) -> bulk.Outcome:
        from calmq.jobs import TERMINAL

        tenant_id = self._tenant.get(job_id) or await self.store.jobs.tenant_of(job_id)
        if tenant_id is None:
            return bulk.Outcome(job_id, "skipped", "skipped", "not_found",
                                "the job no longer exists")
        if self.dry_run:
            job = await self.store.jobs.view(tenant_id, job_id)
            if job is not None and job.status not in TERMINAL:
                return bulk.Outcome(job_id, "done", "would_cancel", None,
                                    f"would cancel the {job.status} job")
        elif await self.store.jobs.cancel(tenant_id, job_id):
            return bulk.Outcome(job_id, "done", "cancelled", None, "cancelled")
        job = await self.store.jobs.view(tenant_id, job_id)
        if job is None:
            return bulk.Outcome(job_id, "skipped", "skipped", "not_found",
                                "the job no longer exists")
        # The same guard as POST /v1/jobs/{id}/cancel (409 job_terminal): nothing written.
        return bulk.Outcome(job_id, "skipped", "skipped", "job_terminal",
                            f"the job is {job.status} already")


def _cancel(args: argparse.Namespace, settings: Any) -> int:
    from calmq.cli.connect import open_store

    fmt = output_format(args)
    filters = _flag_filters(args)
    if args.resume and (args.job_ids or filters):
        raise UsageError("--resume takes the filter from its checkpoint: give no job ids or "
                         "filters with it", code="resume_with_filter")
    if args.job_ids:
        if filters:
            raise UsageError("name job ids or give filters, not both", code="usage")
        targets = [_job_id(j) for j in args.job_ids]

        async def named() -> list[bulk.Outcome]:
            async with open_store(settings) as store:
                action = _Cancel(store, _search({}, 1, cancellable=True),
                                 dry_run=bool(args.dry_run))
                return await bulk.run_each(targets, action.act,
                                           rate=None if args.dry_run else args.rate)

        return bulk.report(asyncio.run(named()), fmt,
                           done_word="would_cancel" if args.dry_run else "cancelled")
    if not args.resume and not filters:
        raise ConfigError("name job ids or at least one filter (--status, --workflow, "
                          "--tenant, ...); a bare cancel would cancel every job",
                          code="cancel_needs_target")
    # Frozen at the start: --created-before pinned to now, so jobs submitted during the run
    # (or before a resume) are not cancelled by it.
    if not args.resume:
        _search(filters, 1, cancellable=True)  # refuse a bad filter before counting
        created_before = bulk.pinned(_when(filters.get("created_before")), datetime.now(UTC))
        after = _when(filters.get("created_after"))
        filters = {**filters, "created_before": created_before.isoformat(),
                   "created_after": after.isoformat() if after else None,
                   "status": _statuses(filters.get("status"))}

    def make(store: Store, params: dict[str, Any]) -> bulk.Action:
        return _Cancel(store, _search(params, 1, cancellable=True), dry_run=bool(args.dry_run))

    def describe(params: dict[str, Any]) -> str:
        words = [f"created before {params['created_before']}"]
        words += [f"{k.replace('_', '-')}={','.join(v) if isinstance(v, list) else v}"
                  for k, v in params.items() if k != "created_before" and v]
        return ", ".join(words)

    if args.resume:
        filters = bulk.Checkpoint.load(Path(args.resume), "jobs cancel").params
    job = bulk.Bulk(command="jobs cancel", noun="jobs", verb="cancel", done_word="cancelled",
                    params=filters, describe=describe(filters), make=make,
                    resumable=bulk.FrozenFilter(
                        keys=frozenset(_CANCEL_FILTERS), filters=frozenset(_CANCEL_FILTERS),
                        pinned="created_before",
                        parse=lambda p: _search(p, 1, cancellable=True)))
    return bulk.run_bulk(job, settings, fmt=fmt, yes=bool(args.yes), dry_run=bool(args.dry_run),
                         rate=args.rate, page_size=int(args.limit or _PAGE),
                         resume=Path(args.resume) if args.resume else None,
                         checkpoint=Path(args.checkpoint) if args.checkpoint else None)


# -- the parsers ------------------------------------------------------------------------------

def _filters(flags: Flags, p: argparse.ArgumentParser) -> None:
    option = flags.option
    # A comma list rather than a repeated flag: its CALMQ_STATUS variable is one string too.
    option(p, "--status",
           help="only jobs in this status, or a comma list of them: queued, running, "
                "retrying, awaiting_review, completed, dead_letter, cancelled")
    option(p, "--workflow", help="only jobs of this workflow")
    option(p, "--tenant", help="only this tenant's jobs (its name)")
    option(p, "--created-after", help="created at or after: ISO time or a duration ago (2h)")
    option(p, "--created-before", help="created before: ISO time or a duration ago")


def register(command: Command, flags: Flags) -> None:
    option = flags.option
    p = command("submit", cmd_submit, "submit a job through the API", needs=("api_url",))
    option(p, "--api-key", help="the tenant's API key")
    option(p, "--workflow", default="summarize", help="the workflow to run (default summarize)")
    # The API's default (producers.models.SubmitRequest): a script gets the same job either way.
    option(p, "--priority", default=Priority.BULK.value, choices=[p.value for p in Priority],
           help="the job's priority (default bulk, as the API's)")
    option(p, "--text", help="the input text")
    option(p, "--mode", help="the fake provider's mode for this job (success, flaky, ...)")
    option(p, "--input", help="the whole input as JSON (instead of --text and --mode)")
    option(p, "--file", help="submit every line of this JSON Lines file (each a POST /v1/jobs "
                             "body) through POST /v1/jobs/bulk, resumable: a backfill")
    option(p, "--chunk-size", type=int, default=1000,
           help="--file: jobs a request (default 1000, the API's api_bulk_max_jobs)")
    option(p, "--checkpoint", help="--file: where the run records how far it got (default: "
                                   "beside the file, FILE.calmq-checkpoint.json)")
    option(p, "--in-flight", type=int, default=4,
           help="--file: requests in flight at once (default 4)")
    option(p, "--max-chunks", type=int,
           help="--file: stop after this many requests (exit 130; run again to resume)")
    add_output(p)
    p = command("status", cmd_status, "show a job through the API (calmq jobs show reads the "
                "database)", needs=("api_url",))
    option(p, "--api-key", help="the tenant's API key")
    p.add_argument("job_id", help="the job's id")

    p = command("jobs", cmd_jobs, "jobs of every tenant, from the database: list, show, "
                "events, cancel, rerun", needs=("database_url",))
    sub = p.add_subparsers(dest="jobs_action", required=True, metavar="ACTION",
                           help="list, show, events, cancel or rerun")
    ls = sub.add_parser("list", help="a page of jobs, newest first (the API's filters)",
                        description="a page of jobs, newest first (the API's filters)")
    _filters(flags, ls)
    option(ls, "--metadata", action="append",
           help="only jobs whose metadata holds this string value: KEY=VALUE (repeat for "
                "more, all must hold), as GET /v1/jobs?metadata.KEY=VALUE")
    option(ls, "--limit", type=int, help="at most this many (default 50, at most 1000)")
    option(ls, "--cursor", help="the next page: the cursor the previous page printed")
    add_output(ls)
    show = sub.add_parser("show", help="the job's whole story: status, timeline, attempts, "
                          "errors, usage, artifact, trace id",
                          description="the job's whole story: status, timeline, attempts, "
                          "errors, usage, artifact, trace id")
    show.add_argument("job_id", help="the job's id")
    add_output(show)
    ev = sub.add_parser("events", help="the job's history, one event per line with -o jsonl",
                        description="the job's history, one event per line with -o jsonl")
    ev.add_argument("job_id", help="the job's id")
    option(ev, "--follow", "-f", action="store_true",
           help="keep printing new events until the job ends")
    add_output(ev)
    cancel = sub.add_parser(
        "cancel", help="cancel named jobs, or every match of the filters (a bulk action)",
        description="cancel named jobs, or every match of the filters (a bulk action: count, "
                    "confirmation or --yes, progress, resumable with --resume)")
    cancel.add_argument("job_ids", nargs="*", help="the jobs to cancel (none: the filters)")
    _filters(flags, cancel)
    option(cancel, "--limit", type=int,
           help=f"the page size (default {_PAGE}); every match is cancelled whatever it is")
    option(cancel, "--rate", type=float, help="at most this many jobs per second")
    option(cancel, "--dry-run", action="store_true", help="say what would happen, write nothing")
    option(cancel, "--yes", "-y", action="store_true",
           help="go on without asking (required when not on a terminal)")
    option(cancel, "--checkpoint", help="write the resume checkpoint here (default: a new "
                                        "file under ~/.local/state/calmq/bulk)")
    option(cancel, "--resume", help="continue the interrupted run of this checkpoint file")
    add_output(cancel)
    reruns.add_parser(sub, flags)
