"""``calmq jobs rerun``: rerun named jobs, or every match of a filter, from a step.

The bulk form is one of calmq.cli.bulk's actions (count, confirmation or ``--yes``,
progress, checkpoint and ``--resume``), with what a rerun adds:

- the filter is of jobs that ended (a rerun starts from a job that is completed,
  dead-lettered or cancelled): ``--workflow`` (required: the step is one of its steps),
  ``--status`` (default: all three), ``--code`` (the failure code), ``--tenant``,
  ``--metadata KEY=VALUE`` (repeatable: every pair must hold) and the creation times;
- the count line carries the estimated cost: what the matches' attempts of the steps to
  run again cost when they ran (their recorded ``cost_usd`` and tokens);
- it paces itself through the token budget: without ``--rate``, and with
  ``budget_tokens_per_minute`` (or ``budget_requests_per_minute``) set, at most the jobs a
  second whose recorded tokens (calls) fit a tenant's default share
  (``budget_tenant_share``) of the bulk part of the budget (what
  ``budget_interactive_share`` leaves), so interactive work keeps its share while it runs;
- a resumed run skips a job that has a rerun made since the run started (``rerun_since``):
  one rerun after a kill -9 between two checkpoints is not made twice. A first run does
  not ask (its frozen filter yields each job once, and its reruns are newer than the
  filter's pinned end); named jobs do (a job named twice is rerun once);
- each rerun is two round trips to the database (the original read with its recorded
  steps, and the one statement that writes the rerun): calmq.data.reruns.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import getpass
import socket
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from calmq.cli import bulk
from calmq.cli.flags import json_object, key_values
from calmq.cli.output import add_output, output_format
from calmq.cli.times import when as _when
from calmq.errors import ContractError, NotFound, UsageError

if TYPE_CHECKING:
    from calmq.cli.flags import Flags
    from calmq.data import Store
    from calmq.data.reruns import RerunSearch
    from calmq.reruns import Reruns
    from calmq.settings import Settings

__all__ = ["add_parser", "cmd_rerun"]

_PAGE = 500
_ENDED = ("completed", "dead_letter", "cancelled")  # calmq.jobs.TERMINAL, in a stable order
_FILTERS = ("workflow", "status", "code", "tenant", "metadata", "created_after",
            "created_before")
# What a resumed run takes from its checkpoint besides the filter.
_RUN = ("from_step", "input", "priority", "since", "by")


def _statuses(values: str | list[str] | None) -> list[str]:
    if isinstance(values, str):
        values = [values]
    found = [s.strip() for v in values or [] for s in v.split(",") if s.strip()]
    if not set(found) <= set(_ENDED):
        raise UsageError(f"--status: only a job that ended can be rerun: one of "
                         f"{', '.join(_ENDED)}", code="invalid_status")
    return found or list(_ENDED)


def _metadata(values: str | list[str] | dict[str, str] | None) -> dict[str, str] | None:
    """``--metadata KEY=VALUE`` (repeated), or the object a checkpoint saved."""
    if isinstance(values, dict):
        return {str(k): str(v) for k, v in values.items()} or None
    return key_values(values)


def _search(params: dict[str, Any], steps: tuple[str, ...] = ()) -> RerunSearch:
    """The frozen filter as the data layer's search (raises UsageError on a bad one)."""
    from calmq.data.reruns import RerunSearch

    if not params.get("workflow"):
        raise UsageError("--workflow is required: --from-step names one of its steps",
                         code="workflow_required")
    before = _when(params.get("created_before"))
    return RerunSearch(
        workflow=str(params["workflow"]), statuses=_statuses(params.get("status")),
        created_before=before or datetime.now(UTC), steps=steps, tenant=params.get("tenant"),
        code=params.get("code"), metadata=_metadata(params.get("metadata")),
        created_after=_when(params.get("created_after")))


def _who() -> str:
    return f"{getpass.getuser()}@{socket.gethostname()}"


class _Rerun:
    """The bulk rerun of calmq.cli.bulk: the frozen filter's jobs, newest first."""

    def __init__(self, reruns: Reruns, params: dict[str, Any], *, dry_run: bool,
                 check_since: bool = True) -> None:
        self.reruns, self.params, self.dry_run = reruns, params, dry_run
        # Whether a job may have a rerun of this run already: a resumed run, named jobs.
        self.check_since = check_since
        # Named jobs (no filter) are never counted or paged.
        self.which = _search(params) if params.get("workflow") else None
        self.since = datetime.fromisoformat(str(params["since"]))

    def _after(self, after: bulk.Key | None, size: int) -> RerunSearch:
        assert self.which is not None, "a bulk rerun has its filter"
        at, ident = after if after is not None else (None, None)
        return dataclasses.replace(self.which, cursor_at=at, cursor_id=ident, limit=size)

    async def count(self, after: bulk.Key | None) -> int:
        return (await self.reruns.records.estimate(self._after(after, 1))).jobs

    async def page(self, after: bulk.Key | None, size: int
                   ) -> list[tuple[bulk.Key, uuid.UUID]]:
        rows = await self.reruns.records.matches(self._after(after, size))
        return [((r.created_at, r.id), r.id) for r in rows]

    async def act(self, job_id: uuid.UUID) -> bulk.Outcome:
        step = str(self.params["from_step"])
        if self.check_since and await self.reruns.records.rerun_since(job_id, self.since):
            return bulk.Outcome(job_id, "skipped", "skipped", "rerun_already",
                                "this run made its rerun already (before an interruption)")
        try:
            original = await self.reruns.original(job_id, None)
            plan = self.reruns.plan(original, step, replacement=self.params.get("input"),
                                    priority=self.params.get("priority"))
            if self.dry_run:
                return bulk.Outcome(job_id, "done", "would_rerun", None,
                                    f"would rerun from {step}")
            made = await self.reruns.write(original, plan, by=self.params.get("by"))
        except NotFound:
            return bulk.Outcome(job_id, "skipped", "skipped", "not_found",
                                "the job no longer exists")
        except ContractError as exc:
            return bulk.Outcome(job_id, "failed", "rejected", exc.code, exc.message)
        return bulk.Outcome(job_id, "done", "rerun", None, f"rerun as {made.job_id}",
                            {"rerun": str(made.job_id)})


def _pace(settings: Settings, jobs: int, tokens: int, calls: int
          ) -> tuple[float | None, str]:
    """The jobs a second the budget allows a bulk rerun, and how it was found: the slower
    of what its tokens a minute and its requests a minute serve at the matches' recorded
    tokens and calls a job."""
    share = (1 - settings.budget_interactive_share) * settings.budget_tenant_share
    rates: list[tuple[float, str]] = []
    tpm, rpm = settings.budget_tokens_per_minute, settings.budget_requests_per_minute
    if tpm and jobs and tokens:
        per_job = tokens / jobs
        rates.append((tpm * share / per_job / 60,
                      f"{share:.0%} of budget_tokens_per_minute ({tpm}) at {per_job:.0f} "
                      "recorded tokens a job"))
    if rpm and jobs and calls:
        per_job = calls / jobs
        rates.append((rpm * share / per_job / 60,
                      f"{share:.0%} of budget_requests_per_minute ({rpm}) at {per_job:.2f} "
                      "recorded calls a job"))
    if not rates:
        return None, "not paced (no --rate, and no budget or no recorded usage)"
    rate, why = min(rates)
    return rate, f"paced at {rate:.2f} jobs/s: {why}"


def cmd_rerun(args: argparse.Namespace, settings: Settings) -> int:
    from calmq.cli.connect import open_store
    from calmq.reruns import Reruns
    from calmq.workflows import load_workflows

    fmt = output_format(args)
    workflows = load_workflows(settings)
    filters = {k: getattr(args, k) for k in _FILTERS if getattr(args, k, None)}
    replacement = json_object(args.input) if args.input else None
    if args.resume and (args.job_ids or filters or args.from_step):
        raise UsageError("--resume takes the filter and the step from its checkpoint: give "
                         "no job ids, filters or --from-step with it", code="resume_with_filter")
    if not args.resume and not args.from_step:
        raise UsageError("--from-step is required: the step the reruns start at",
                         code="from_step_required")

    def make(store: Store, params: dict[str, Any]) -> bulk.Action:
        return _Rerun(Reruns(store, workflows), params, dry_run=bool(args.dry_run),
                      check_since=bool(args.resume))

    if args.job_ids:
        if filters:
            raise UsageError("name job ids or give filters, not both", code="usage")
        targets = [_job_id(j) for j in args.job_ids]
        params = {"from_step": args.from_step, "input": replacement,
                  "priority": args.priority, "since": datetime.now(UTC).isoformat(),
                  "by": _who()}

        async def named() -> list[bulk.Outcome]:
            async with open_store(settings) as store:
                action = _Rerun(Reruns(store, workflows), params, dry_run=bool(args.dry_run))
                return await bulk.run_each(targets, action.act,
                                           rate=None if args.dry_run else args.rate)

        return bulk.report(asyncio.run(named()), fmt,
                           done_word="would_rerun" if args.dry_run else "rerun")
    if args.resume:
        params = bulk.Checkpoint.load(Path(args.resume), "jobs rerun").params
    else:
        _search(filters)  # refuse a bad filter before counting
        created_before = bulk.pinned(_when(filters.get("created_before")), datetime.now(UTC))
        after = _when(filters.get("created_after"))
        params = {**filters, "created_before": created_before.isoformat(),
                  "created_after": after.isoformat() if after else None,
                  "status": _statuses(filters.get("status")),
                  "metadata": _metadata(filters.get("metadata")),
                  "from_step": args.from_step, "input": replacement,
                  "priority": args.priority, "since": datetime.now(UTC).isoformat(),
                  "by": _who()}
    workflow = workflows.get(str(params.get("workflow")))
    if workflow is None:
        raise UsageError(f"unknown workflow {params.get('workflow')!r}; known: "
                         f"{', '.join(sorted(workflows))}", code="unknown_workflow")
    try:
        start = workflow.index(str(params["from_step"]))
    except ContractError:
        raise UsageError(f"workflow {workflow.name} has no step {params['from_step']!r}; its "
                         f"steps: {', '.join(s.name for s in workflow.steps)}",
                         code="unknown_step") from None
    steps = tuple(s.name for s in workflow.steps[start:])

    async def estimate() -> tuple[int, float, int, int]:
        async with open_store(settings) as store:
            found = await Reruns(store, workflows).records.estimate(_search(params, steps))
        return found.jobs, found.cost_usd, found.tokens, found.calls

    jobs, cost, tokens, calls = asyncio.run(estimate())
    rate, pacing = (args.rate, f"at most {args.rate} jobs/s (--rate)") if args.rate else _pace(
        settings, jobs, tokens, calls)

    def describe(p: dict[str, Any]) -> str:
        words = [f"from step {p['from_step']} ({', '.join(steps)} run again)",
                 f"created before {p['created_before']}"]
        words += [f"{k.replace('_', '-')}={_shown(v)}" for k, v in p.items()
                  if k in _FILTERS and k != "created_before" and v]
        words.append(f"estimated cost ${cost:.4f} ({tokens} tokens: what those steps of the "
                     "matching jobs cost when they ran)")
        words.append(pacing)
        return ", ".join(words)

    job = bulk.Bulk(command="jobs rerun", noun="jobs", verb="rerun", done_word="rerun",
                    params=params, describe=describe(params), make=make,
                    resumable=bulk.FrozenFilter(
                        keys=frozenset(_FILTERS + _RUN), filters=frozenset(_FILTERS),
                        pinned="created_before", parse=_search))
    return bulk.run_bulk(job, settings, fmt=fmt, yes=bool(args.yes),
                         dry_run=bool(args.dry_run), rate=rate,
                         page_size=int(args.limit or _PAGE),
                         resume=Path(args.resume) if args.resume else None,
                         checkpoint=Path(args.checkpoint) if args.checkpoint else None)


def _shown(value: Any) -> str:
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    if isinstance(value, dict):
        return ",".join(f"{k}={v}" for k, v in value.items())
    return str(value)


def _job_id(text: str) -> uuid.UUID:
    try:
        return uuid.UUID(text)
    except ValueError:
        raise UsageError(f"{text!r} is not a job id", code="invalid_job_id") from None



def add_parser(sub: Any, flags: Flags) -> None:
    """``calmq jobs rerun``, under the ``jobs`` command's subparsers."""
    option = flags.option
    p = sub.add_parser(
        "rerun", help="rerun named jobs, or every match of the filters, from a step (a bulk "
                      "action)",
        description="rerun jobs that ended from a step: each becomes a new job that reuses "
                    "the recorded outputs of the steps before it (a bulk action: count and "
                    "estimated cost, confirmation or --yes, progress, paced by the token "
                    "budget, resumable with --resume)")
    p.add_argument("job_ids", nargs="*", help="the jobs to rerun (none: the filters)")
    option(p, "--from-step", help="the step the reruns start at (required)")
    option(p, "--input", help="a JSON object the step gets instead (the job's input for the "
                              "first step, otherwise the previous step's output)")
    option(p, "--priority", choices=["interactive", "bulk"], default="bulk",
           help="the reruns' priority (default bulk: a bulk rerun never takes interactive's "
                "place)")
    option(p, "--workflow", help="only jobs of this workflow (required with filters)")
    option(p, "--status", help="only jobs in this status, or a comma list: completed, "
                               "dead_letter, cancelled (default: all three)")
    option(p, "--code", help="only jobs that failed with this failure code")
    option(p, "--tenant", help="only this tenant's jobs (its name)")
    option(p, "--metadata", action="append",
           help="only jobs whose metadata holds KEY=VALUE (repeat: every pair)")
    option(p, "--created-after", help="created at or after: ISO time or a duration ago (2h)")
    option(p, "--created-before", help="created before: ISO time or a duration ago")
    option(p, "--limit", type=int,
           help=f"the page size (default {_PAGE}); every match is rerun whatever it is")
    option(p, "--rate", type=float, help="at most this many jobs per second (default: from "
                                         "the token budget, when one is set)")
    option(p, "--dry-run", action="store_true", help="say what would happen, write nothing")
    option(p, "--yes", "-y", action="store_true",
           help="go on without asking (required when not on a terminal)")
    option(p, "--checkpoint", help="write the resume checkpoint here (default: a new file "
                                   "under ~/.local/state/calmq/bulk)")
    option(p, "--resume", help="continue the interrupted run of this checkpoint file")
    add_output(p)
