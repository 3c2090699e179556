"""Bulk actions by filter (``dlq redrive``, ``jobs cancel``): count, confirm, page, pace, resume.

One engine for every bulk action, so that they all behave the same at 3 a.m.:

1. The filter is frozen when the run starts: its upper time bound (``--until``, or
   ``--created-before``) is pinned to the start time, so a job that matches only later
   (dead-lettered a minute after the redrive began) is never swept in unintentionally.
2. The count is printed first; on a terminal the person types ``y``/``yes`` to go on,
   elsewhere ``--yes`` is required (without it: exit 2, nothing done).
3. Matches are read a page at a time by keyset (the action's sort key and the job id), so
   any number is processed whatever the page size (``--limit``), at most ``--rate`` jobs
   per second, with a progress bar (a terminal) or a progress line every tenth of the work
   or every few seconds (a log) on stderr.
4. Resume: after each page (and on Ctrl-C, SIGTERM or any failure) a checkpoint file is
   written atomically: the frozen filter, the key of the last job handled and the counts so
   far. ``--resume FILE`` starts after that key with the same filter, so no job is redone
   and none is skipped. Should the process die between two checkpoints (kill -9), the jobs
   it handled since are no longer matches (a redriven job is not a dead letter, a cancelled
   one is terminal): the resumed run reads them again and its guarded statement leaves
   them alone, so even then no job is acted on twice.
5. A summary: done, skipped with the reason, failed with the reason. Exit 0 when all is
   done, 3 when some jobs failed, 130 when interrupted (resumable), 1 on an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import signal
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TextIO

from calmq.cli.output import Exit, Format, jsonable
from calmq.errors import CalmqError, ConfigError, UsageError

if TYPE_CHECKING:
    from calmq.data import Store
    from calmq.settings import Settings

__all__ = ["Action", "Bulk", "Checkpoint", "Key", "Outcome", "Progress", "pinned", "report",
           "run_bulk", "run_each", "summary_line"]

Key = tuple[datetime, uuid.UUID]
Kind = Literal["done", "skipped", "failed"]

CHECKPOINT_VERSION = 1
_PLAIN_EVERY_SECONDS = 5.0  # a log gets a progress line at least this often
_TTY_REDRAW_SECONDS = 0.1
_TABLE_LINES = 50  # outcomes listed in the table summary; json and jsonl have them all


@dataclass(frozen=True, slots=True)
class Outcome:
    """What the action did to one job: ``kind`` sorts it, ``code`` says why (not done)."""

    job_id: uuid.UUID
    kind: Kind
    outcome: str  # the action's own word: redriven, would_redrive, cancelled, rejected, ...
    code: str | None = None
    message: str = ""
    extra: Mapping[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {"job_id": str(self.job_id), "outcome": self.outcome, "code": self.code,
                "message": self.message, **self.extra}


class Action(Protocol):
    """One bulk action on an open store; ``page`` and ``count`` read only the frozen filter."""

    async def count(self, after: Key | None) -> int: ...

    async def page(self, after: Key | None, size: int) -> list[tuple[Key, uuid.UUID]]: ...

    async def act(self, job_id: uuid.UUID) -> Outcome: ...


@dataclass(frozen=True)
class Bulk:
    """A bulk action as a command describes it.

    ``params`` is everything that must stay the same on a resume (the frozen filter, the
    reason): it goes into the checkpoint and comes back from it. ``make`` builds the action
    from an open store and those params.
    """

    command: str  # "dlq redrive": the checkpoint's kind and the resume hint
    noun: str  # plural, for the count line: "dead letters"
    verb: str  # "redrive"
    done_word: str  # "redriven" (dry run: the action reports would_<verb>)
    params: dict[str, Any]
    describe: str  # the frozen filter in words, for the count line
    make: Callable[[Store, dict[str, Any]], Action]
    # What a resumed run's checkpoint must hold to be used (``FrozenFilter.check``): the
    # file is read back from disk, so it is checked like the flags it stands for.
    resumable: FrozenFilter | None = None


@dataclass(frozen=True)
class FrozenFilter:
    """The shape of a command's frozen filter, to check a checkpoint against on ``--resume``.

    A checkpoint is a file: edited by hand, planted by another user, or written by another
    version, it could widen the filter (drop ``--tenant``, move the frozen bound past the
    run's start, leave no filter at all) and the resumed run would act on jobs the operator
    never chose. ``check`` holds it to the rules the flags are held to.
    """

    keys: frozenset[str]  # every key the params may have (filters, reason, by, ...)
    filters: frozenset[str]  # of those, the ones that narrow the match
    pinned: str  # the upper time bound frozen at the start (until, created_before)
    parse: Callable[[dict[str, Any]], object]  # the command's own filter check (raises)

    def check(self, path: Path, params: dict[str, Any], started_at: str) -> None:
        def refuse(why: str) -> ConfigError:
            return ConfigError(f"{path} cannot be resumed: {why}; start a new run with "
                               "the filter you mean", code="invalid_checkpoint")

        unknown = sorted(set(params) - self.keys)
        if unknown:
            raise refuse(f"it holds keys this command does not write ({', '.join(unknown)})")
        try:
            started = datetime.fromisoformat(started_at)
            bound = datetime.fromisoformat(str(params.get(self.pinned)))
        except ValueError:
            raise refuse(f"its {self.pinned} or start time is not a time") from None
        if bound.tzinfo is None or started.tzinfo is None or bound > started:
            raise refuse(f"its {self.pinned} ({bound.isoformat()}) is not frozen at or "
                         f"before the run's start ({started_at})")
        narrowing = [k for k in self.filters if k != self.pinned and params.get(k)]
        if not narrowing and bound >= started:
            raise refuse("it holds no filter, so it would match every job")
        try:
            self.parse(params)
        except CalmqError as exc:
            raise refuse(f"its filter is not valid ({exc.message})") from None


@dataclass
class Checkpoint:
    """Where a bulk run is: written after each page, read back by ``--resume``."""

    path: Path
    command: str
    params: dict[str, Any]
    started_at: str
    after: Key | None = None
    done: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    finished: bool = False

    def save(self) -> None:
        """Write atomically (temp file, then rename): a crash leaves the old or the new one."""
        body = {
            "version": CHECKPOINT_VERSION, "command": self.command, "params": self.params,
            "started_at": self.started_at, "finished": self.finished,
            "after": None if self.after is None else [self.after[0].isoformat(),
                                                      str(self.after[1])],
            "done": self.done, "skipped": dict(self.skipped), "failed": dict(self.failed),
        }
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(jsonable(body), indent=2) + "\n")
        os.replace(tmp, self.path)

    @classmethod
    def load(cls, path: Path, command: str) -> Checkpoint:
        try:
            body = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"no checkpoint at {path}: give the file an interrupted run "
                              "printed", code="checkpoint_not_found") from None
        except ValueError as exc:
            raise ConfigError(f"{path} is not a checkpoint calmq wrote ({exc})",
                              code="invalid_checkpoint") from None
        if not isinstance(body, dict) or body.get("version") != CHECKPOINT_VERSION:
            raise ConfigError(f"{path} is not a checkpoint this calmq wrote",
                              code="invalid_checkpoint")
        owner = path.stat().st_uid if hasattr(os, "getuid") else None
        if owner is not None and owner not in (os.getuid(), 0):
            raise ConfigError(f"{path} belongs to another user (uid {owner}): a checkpoint "
                              "decides which jobs a run acts on, so only your own is resumed",
                              code="invalid_checkpoint")
        if body.get("command") != command:
            raise ConfigError(f"{path} is a checkpoint of `calmq {body.get('command')}`, "
                              f"not of `calmq {command}`", code="invalid_checkpoint")
        after = body.get("after")
        return cls(
            path=path, command=command, params=dict(body["params"]),
            started_at=str(body["started_at"]),
            after=None if after is None else (datetime.fromisoformat(after[0]),
                                              uuid.UUID(after[1])),
            done=int(body.get("done", 0)), skipped=Counter(body.get("skipped", {})),
            failed=Counter(body.get("failed", {})), finished=bool(body.get("finished")),
        )


def state_dir(configured: str = "") -> Path:
    """Where the CLI keeps its checkpoints: ``cli_state_dir`` when set, else the user's state
    folder (XDG), else, when there is none to write (a container's read-only root filesystem
    with no home folder), a folder of its own under the temporary directory."""
    if configured:
        return Path(configured)
    xdg = os.environ.get("XDG_STATE_HOME")
    candidates = [Path(xdg)] if xdg else []
    with contextlib.suppress(RuntimeError, KeyError):  # no home folder at all
        candidates.append(Path.home() / ".local" / "state")
    for base in candidates:
        try:
            (base / "calmq").mkdir(parents=True, exist_ok=True)
        except OSError:
            continue
        if os.access(base / "calmq", os.W_OK):
            return base / "calmq"
    return Path(tempfile.gettempdir()) / f"calmq-{os.getuid()}"


def default_checkpoint(command: str, configured: str = "") -> Path:
    """A new file under the CLI's state folder (``state_dir``), one per run."""
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    name = f"{command.replace(' ', '-')}-{stamp}-{uuid.uuid4().hex[:6]}.json"
    return state_dir(configured) / "bulk" / name


def target(settings: Settings) -> str:
    """What a bulk action acts on, named in its confirmation: the database's host, port and
    name, and the Kafka cluster's bootstrap servers, so that a shell still pointed at
    production says so before anything is touched."""
    import psycopg
    from psycopg.conninfo import conninfo_to_dict

    try:
        info = conninfo_to_dict(settings.database_url)
    except psycopg.ProgrammingError:  # a URL it cannot read fails later, with its error
        info = {}
    where = f"{info.get('host') or 'localhost'}:{info.get('port') or 5432}"
    database = f"{where}/{info.get('dbname') or '?'}"
    from calmq.cli.contexts import active

    context = active()
    named = f"context {context[0]}: " if context else ""
    return f"{named}database {database}, Kafka {settings.kafka_bootstrap or '(not set)'}"


def refuse_yes_from_environment() -> None:
    """A bulk confirmation is only ever given on the command line: a ``CALMQ_YES`` left in a
    shell profile or a CI job's environment would answer every later one, production's too."""
    if "CALMQ_YES" in os.environ:
        raise UsageError(
            "CALMQ_YES is not read: a bulk action is confirmed on its command line with "
            "--yes, never by the environment; unset CALMQ_YES",
            code="confirmation_from_environment")


def _duration(seconds: float) -> str:
    seconds = max(0, int(seconds + 0.5))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


class Progress:
    """Count, rate and ETA on stderr: a redrawn bar on a terminal, plain lines in a log."""

    def __init__(self, verb: str, total: int, *, out: TextIO, tty: bool,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.verb, self.total, self.out, self.tty, self.clock = verb, total, out, tty, clock
        self.started = clock()
        self.n = 0
        # A bar is drawn at once; a log's first line waits for a tenth of the work or for
        # the few seconds, like every later one.
        self._last_draw = float("-inf") if tty else self.started
        self._last_line_n = 0
        self._every = max(1, total // 10)

    def line(self) -> str:
        total = max(self.total, self.n)  # a job may come to match during the run
        elapsed = self.clock() - self.started
        rate = self.n / elapsed if elapsed > 0 else 0.0
        eta = _duration((total - self.n) / rate) if rate > 0 else "?"
        pct = 100.0 * self.n / total if total else 100.0
        if not self.tty:
            return (f"{self.verb}: {self.n}/{total} ({pct:.0f}%), {rate:.1f} jobs/s, "
                    f"ETA {eta}")
        width = 30
        filled = int(width * self.n / total) if total else width
        bar = "#" * filled + "." * (width - filled)
        return f"{self.verb} [{bar}] {self.n}/{total} {pct:3.0f}% {rate:6.1f}/s ETA {eta}"

    def advance(self, n: int = 1) -> None:
        self.n += n
        now = self.clock()
        if self.tty:
            if now - self._last_draw >= _TTY_REDRAW_SECONDS:
                self._draw(now)
        elif (self.n - self._last_line_n >= self._every
              or now - self._last_draw >= _PLAIN_EVERY_SECONDS):
            self._draw(now)

    def _draw(self, now: float) -> None:
        self._last_draw, self._last_line_n = now, self.n
        if self.tty:
            print(f"\r\x1b[2K{self.line()}", end="", file=self.out, flush=True)
        else:
            print(self.line(), file=self.out, flush=True)

    def finish(self) -> None:
        if self.n != self._last_line_n or self.tty:
            self._draw(self.clock())
        if self.tty:
            print(file=self.out, flush=True)


def _confirm(question: str) -> bool:
    """Ask on the terminal; only a typed y or yes goes on (Enter alone means no)."""
    print(f"{question} [y/N] ", end="", file=sys.stderr, flush=True)
    answer = sys.stdin.readline()
    return answer.strip().lower() in ("y", "yes")


@dataclass
class _Run:
    outcomes: list[Outcome] = field(default_factory=list)
    interrupted: bool = False
    completed: bool = False  # every match handled (not stopped, no error)


def run_bulk(bulk: Bulk, settings: Settings, *, fmt: Format, yes: bool, dry_run: bool,
             rate: float | None, page_size: int, resume: Path | None,
             checkpoint: Path | None) -> int:
    """Run ``bulk`` to the end (or to an interruption); returns the exit code."""
    from calmq.cli.connect import open_store

    refuse_yes_from_environment()
    if rate is not None and rate <= 0:
        raise UsageError("--rate is a positive number of jobs per second", code="invalid_rate")
    if resume is not None:
        state = Checkpoint.load(resume, bulk.command)
        if bulk.resumable is not None:
            bulk.resumable.check(resume, state.params, state.started_at)
        bulk = dataclasses.replace(bulk, params=state.params)
    else:
        state = Checkpoint(path=checkpoint or default_checkpoint(bulk.command,
                                                                 settings.cli_state_dir),
                           command=bulk.command, params=bulk.params,
                           started_at=datetime.now(UTC).isoformat())
    if state.finished:
        print(f"calmq: the run in {state.path} finished already; nothing left to do",
              file=sys.stderr)
        _summary(bulk, state, _Run(), matched=0, fmt=fmt, dry_run=False)
        return Exit.OK

    async def count() -> int:
        async with open_store(settings) as store:
            return await bulk.make(store, state.params).count(state.after)

    matched = asyncio.run(count())
    before = state.done + sum(state.skipped.values()) + sum(state.failed.values())
    resumed = f" ({before} handled before the interruption)" if resume is not None else ""
    print(f"{matched} {bulk.noun} to {bulk.verb}{resumed}: {bulk.describe} "
          f"(on {target(settings)})", file=sys.stderr, flush=True)
    if matched == 0:
        if not dry_run:
            state.finished = True
            state.save()
        _summary(bulk, state, _Run(), matched=0, fmt=fmt, dry_run=dry_run)
        return Exit.OK
    if not yes and not dry_run:
        if not sys.stdin.isatty():
            raise UsageError(
                f"refusing to {bulk.verb} {matched} {bulk.noun} without confirmation: pass "
                "--yes (or run it on a terminal to be asked); --dry-run shows what it would do",
                code="confirmation_required")
        if not _confirm(f"{bulk.verb} {matched} {bulk.noun} on {target(settings)}?"):
            raise ConfigError(f"not confirmed: no {bulk.noun} were touched",
                              code="not_confirmed")
    if not dry_run:
        print(f"checkpoint: {state.path} (after an interruption: "
              f"calmq {bulk.command} --resume {state.path})", file=sys.stderr, flush=True)
        state.save()

    progress = Progress(bulk.verb, matched, out=sys.stderr, tty=sys.stderr.isatty())
    run = _Run()

    async def work() -> None:
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        # Ctrl-C and SIGTERM finish the job in hand, write the checkpoint, then stop: a job
        # is never left half done, and the run can be resumed exactly where it stopped.
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            async with open_store(settings) as store:
                await _pages(bulk.make(store, state.params), state, run, progress, stop,
                             rate=None if dry_run else rate, page_size=page_size,
                             fmt=fmt, dry_run=dry_run)
            run.completed = not stop.is_set()
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.remove_signal_handler(sig)
            run.interrupted = stop.is_set()

    try:
        asyncio.run(work())
    finally:
        progress.finish()
        if not dry_run:
            state.finished = run.completed
            state.save()
    _summary(bulk, state, run, matched=matched, fmt=fmt, dry_run=dry_run)
    if run.interrupted:
        if not dry_run:
            print(f"calmq: interrupted; resume with: calmq {bulk.command} --resume "
                  f"{state.path} --yes", file=sys.stderr)
        return 130
    return Exit.PARTIAL if state.failed else Exit.OK


async def _pages(action: Action, state: Checkpoint, run: _Run, progress: Progress,
                 stop: asyncio.Event, *, rate: float | None, page_size: int, fmt: Format,
                 dry_run: bool) -> None:
    loop = asyncio.get_running_loop()
    started, n = loop.time(), 0
    # A dry run changes nothing, so its pages advance from a cursor of their own and leave
    # the checkpoint (which describes real work) alone.
    after = state.after
    while not stop.is_set():
        page = await action.page(after, page_size)
        if not page:
            return
        for key, job_id in page:
            if rate is not None:
                # Pace against the start, not the previous job, so slow ones do not add up;
                # waiting on the stop event lets Ctrl-C end the wait at once.
                delay = started + n / rate - loop.time()
                if delay > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), timeout=delay)
            if stop.is_set():
                return
            outcome = await action.act(job_id)
            n += 1
            after = key
            _count(state, run, outcome, fmt, dry_run)
            if not dry_run:
                state.after = key
            progress.advance()
        if not dry_run:
            state.save()


def _count(state: Checkpoint, run: _Run, outcome: Outcome, fmt: Format, dry_run: bool) -> None:
    if outcome.kind == "done":
        state.done += 1
    elif outcome.kind == "skipped":
        state.skipped[outcome.code or outcome.outcome] += 1
    else:
        state.failed[outcome.code or outcome.outcome] += 1
    if fmt == "jsonl":
        print(json.dumps(jsonable(outcome.as_dict())), flush=True)
    elif fmt == "json" or outcome.kind != "done":
        run.outcomes.append(outcome)


def _summary(bulk: Bulk, state: Checkpoint, run: _Run, *, matched: int, fmt: Format,
             dry_run: bool) -> None:
    done_word = f"would_{bulk.verb}" if dry_run else bulk.done_word
    summary: dict[str, Any] = {
        "command": bulk.command, "matched": matched, "dry_run": dry_run,
        "done": state.done, "skipped": dict(state.skipped), "failed": dict(state.failed),
        "interrupted": run.interrupted, "finished": state.finished and not dry_run,
        "checkpoint": None if dry_run else str(state.path),
    }
    if fmt == "jsonl":
        print(json.dumps(jsonable({"summary": summary})), flush=True)
        return
    if fmt == "json":
        print(json.dumps(jsonable({**summary, "outcomes": [o.as_dict() for o in run.outcomes]}),
                         indent=2))
        return
    for o in run.outcomes[:_TABLE_LINES]:
        print(f"{o.job_id}  {o.outcome:<13} {o.code or ''} {o.message}".rstrip())
    if len(run.outcomes) > _TABLE_LINES:
        print(f"... and {len(run.outcomes) - _TABLE_LINES} more (-o jsonl lists every one)")
    print(summary_line(state.done, done_word, state.skipped, state.failed))


def summary_line(done: int, done_word: str, skipped: Mapping[str, int],
                 failed: Mapping[str, int]) -> str:
    """``12 redriven, 2 skipped (not_dead_lettered: 2), 1 failed (invalid_input: 1)``."""
    def part(n: int, word: str, why: Mapping[str, int]) -> str:
        reasons = ", ".join(f"{k}: {v}" for k, v in sorted(why.items()))
        return f"{n} {word}" + (f" ({reasons})" if reasons else "")

    parts = [part(done, done_word, {})]
    if skipped:
        parts.append(part(sum(skipped.values()), "skipped", skipped))
    if failed:
        parts.append(part(sum(failed.values()), "failed", failed))
    return ", ".join(parts)


def pinned(until: datetime | None, now: datetime) -> datetime:
    """The filter's upper bound frozen at the start: the earlier of the flag and now."""
    return now if until is None or until > now else until


async def run_each(job_ids: list[uuid.UUID], act: Callable[[uuid.UUID], Awaitable[Outcome]],
                   *, rate: float | None) -> list[Outcome]:
    """Named jobs (no filter): each in turn at most ``rate`` per second; no paging needed."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    out = []
    for n, job_id in enumerate(job_ids):
        if rate is not None:
            await asyncio.sleep(max(0.0, started + n / rate - loop.time()))
        out.append(await act(job_id))
    return out


def report(outcomes: list[Outcome], fmt: Format, *, done_word: str) -> int:
    """What ``run_each`` did, in ``fmt``; exit 3 when some job failed."""
    done = sum(o.kind == "done" for o in outcomes)
    skipped = Counter(o.code or o.outcome for o in outcomes if o.kind == "skipped")
    failed = Counter(o.code or o.outcome for o in outcomes if o.kind == "failed")
    summary = {"matched": len(outcomes), "done": done, "skipped": dict(skipped),
               "failed": dict(failed)}
    if fmt == "json":
        print(json.dumps(jsonable({**summary, "outcomes": [o.as_dict() for o in outcomes]}),
                         indent=2))
    elif fmt == "jsonl":
        for o in outcomes:
            print(json.dumps(jsonable(o.as_dict())))
        print(json.dumps({"summary": summary}))
    else:
        for o in outcomes:
            print(f"{o.job_id}  {o.outcome:<13} {o.code or ''} {o.message}".rstrip())
        print(summary_line(done, done_word, skipped, failed))
    return Exit.PARTIAL if failed else Exit.OK
