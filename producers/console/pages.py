"""The console's pages: sign-in, overview, jobs, a job, the review queue, dead letters.

Each page reads through the same code the JSON API uses (calmq.reviews, calmq.deadletters,
the jobs store) and, for the lists, calmq.data.console; every action goes through the same
operation as its /v1 route, with the signed-in key's audit identity
(``tenant <name> key <prefix>``) as who did it, so it shows in the job's history.
"""

from __future__ import annotations

import contextlib
import json
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

from aiohttp import web
from pydantic import BaseModel

from calmq.data import Tenant
from calmq.data.console import ConsoleJob, ConsoleReads, JobQuery
from calmq.data.deadletters import DeadLetter
from calmq.data.observability import replication_slots
from calmq.deadletters import DeadLetterFilter, DeadLetters
from calmq.errors import ContractError, NotFound
from calmq.jobs import TERMINAL, EventType, Status
from calmq.producers.auth import key_tenant
from calmq.producers.console import CONSUMER_LAG
from calmq.producers.console.charts import bars
from calmq.producers.console.html import Markup, Page, ago, esc, form, layout, table, when
from calmq.producers.console.lag import FleetLag, GroupLag
from calmq.producers.console.session import (
    COOKIE,
    CSRF_COOKIE,
    guard,
    html_response,
    new_login_token,
    redirect,
    safe_next,
    scope,
    set_cookie,
)
from calmq.producers.context import OBJECTS, SETTINGS, STORE, WORKFLOWS
from calmq.producers.timestamps import format_time, parse_time
from calmq.producers.uploads import tenant_owns
from calmq.reviews import Decision, ReviewDesk

__all__ = ["HANDLERS"]

_PREVIEW_BYTES = 4096
_STATUSES = [s.value for s in Status]
_PRIORITIES = ("interactive", "bulk")
_LANES = ("online", "batch")


# -- sign-in ------------------------------------------------------------------------------------

def _sign_in_page(request: web.Request, token: str, error: str = "", status: int = 200
                  ) -> web.Response:
    nxt = safe_next(request.query.get("next"))
    alert = f'<p class="error" role="alert">{esc(error)}</p>' if error else ""
    body = (f"{alert}<p>Sign in with an API key of your tenant "
            "(<code>calmq tenants add-key NAME --roles review</code>).</p>"
            f'<form method="post" action="/console/sign-in?next={esc(_q(nxt))}" class="card">'
            f'<input type="hidden" name="csrf" value="{esc(token)}">'
            '<label for="api_key">API key</label>'
            '<input id="api_key" name="api_key" type="password" autocomplete="off" required '
            'autofocus spellcheck="false">'
            '<button type="submit">Sign in</button></form>')
    response = html_response(layout("Sign in", body, None), status)
    set_cookie(request, response, CSRF_COOKIE, token, path="/console/sign-in")
    return response


async def sign_in_form(request: web.Request) -> web.StreamResponse:
    return _sign_in_page(request, new_login_token())


async def sign_in(request: web.Request) -> web.StreamResponse:
    form_data = await request.post()
    token = request.cookies.get(CSRF_COOKIE, "")
    if not token or str(form_data.get("csrf", "")) != token:
        return _sign_in_page(request, new_login_token(),
                             "the sign-in form expired; try again", 403)
    key = str(form_data.get("api_key", "")).strip()
    found = await key_tenant(request, key) if key else None
    if found is None:
        return _sign_in_page(request, new_login_token(),
                             "that API key is unknown or revoked", 401)
    response = redirect(safe_next(request.query.get("next")))
    set_cookie(request, response, COOKIE, key)
    response.del_cookie(CSRF_COOKIE, path="/console/sign-in")
    return response


@guard()
async def sign_out(request: web.Request, caller: Tenant, page: Page) -> web.StreamResponse:
    response = redirect("/console/sign-in")
    response.del_cookie(COOKIE, path="/")
    return response


async def index(request: web.Request) -> web.StreamResponse:
    return redirect("/console/overview")


# -- helpers ------------------------------------------------------------------------------------

def _q(text: str) -> str:
    from urllib.parse import quote

    return quote(text, safe="/")


def _reads(request: web.Request) -> ConsoleReads:
    return ConsoleReads(request.app[STORE])


def _dead(request: web.Request) -> DeadLetters:
    return DeadLetters(request.app[STORE], workflows=request.app[WORKFLOWS],
                       objects=request.app[OBJECTS])


def _job_id(request: web.Request) -> uuid.UUID:
    try:
        return uuid.UUID(request.match_info["job_id"])
    except ValueError as exc:
        raise NotFound("no such job") from exc


def _badge(status: str) -> Markup:
    return Markup(f'<span class="badge {esc(status)}">{esc(status)}</span>')


async def _record(request: web.Request, caller: Tenant, ident: uuid.UUID) -> dict[str, Any]:
    """The job's whole record (row, attempts, history) if the caller may see it."""
    return await _dead(request).show(ident, scope(caller))


def _field_value(raw: str) -> str | None:
    raw = raw.strip()
    return raw or None


# -- overview -----------------------------------------------------------------------------------

@guard()
async def overview(request: web.Request, caller: Tenant, page: Page) -> web.StreamResponse:
    data = await _reads(request).overview(scope(caller))
    now = datetime.now(UTC)
    parts: list[str] = []

    # Backlog and queue age per pool, priority and lane.
    waiting = [r for r in data.backlog if r["status"] in ("queued", "retrying")]
    parts.append('<section aria-labelledby="backlog"><h2 id="backlog">Backlog and queue age'
                 "</h2>")
    parts.append(table("Unfinished jobs by pool, priority, lane and status",
                       ["Pool", "Priority", "Lane", "Status", "Jobs", "Oldest waits"],
                       [(r["pool"], r["priority"], r["lane"], r["status"], r["jobs"],
                         ago(r["oldest_seconds"]))
                        for r in data.backlog], empty="no unfinished jobs"))
    pools = sorted({str(r["pool"]) for r in data.backlog})
    series = []
    for status in ("queued", "retrying", "running", "awaiting_review"):
        series.append((status, [float(sum(r["jobs"] for r in data.backlog
                                          if r["pool"] == p and r["status"] == status))
                                for p in pools]))
    if pools:
        parts.append(bars("Backlog per pool", pools, series))
    oldest = max((r["oldest_seconds"] for r in waiting), default=0.0)
    parts.append(f'<p>Oldest waiting job: <strong data-testid="queue-age">{ago(oldest)}'
                 "</strong></p></section>")

    # Throughput and dead-letter rate, the last hour in 5-minute bins.
    # Every 5-minute bin of the hour, empty ones too, so the chart reads as a time axis.
    last = now.replace(minute=now.minute - now.minute % 5, second=0, microsecond=0)
    bins = [last - timedelta(minutes=5 * i) for i in range(11, -1, -1)]
    labels = [b.strftime("%H:%M") for b in bins]
    done = [float(sum(r["jobs"] for r in data.outcomes if r["bin"] == b
                      and r["type"] == "completed")) for b in bins]
    dead = [float(sum(r["jobs"] for r in data.outcomes if r["bin"] == b
                      and r["type"] == "dead_lettered")) for b in bins]
    total = sum(done) + sum(dead)
    rate = sum(dead) / total if total else 0.0
    parts.append('<section aria-labelledby="throughput"><h2 id="throughput">Throughput</h2>'
                 f"<p>Last hour: {sum(done):.0f} completed, {sum(dead):.0f} dead-lettered "
                 f'(dead-letter rate <strong data-testid="dlq-rate">{rate:.1%}</strong>).</p>')
    parts.append(bars("Jobs finished per 5 minutes", labels,
                      [("completed", done), ("dead-lettered", dead)]))
    parts.append("</section>")

    # Reviews against what the reviewers of each pool can handle.
    pending: dict[str, int] = {}
    wait: dict[str, float] = {}
    for r in data.backlog:
        if r["status"] == "awaiting_review":
            pending[str(r["pool"])] = int(r["jobs"])
            wait[str(r["pool"])] = float(r["oldest_seconds"])
    held = data.review_cap_held or {}
    review_pools = sorted(set(pending) | set(data.review_caps) | set(held))
    rows = []
    for pool in review_pools:
        cap = data.review_caps.get(pool)
        n = pending.get(pool, 0)
        rows.append((pool, n, cap if cap is not None else "none",
                     ago(wait.get(pool, 0.0)) if n else "-", held.get(pool, 0),
                     review_cap_state(n, cap, held.get(pool, 0))))
    parts.append('<section aria-labelledby="reviews"><h2 id="reviews">Reviews</h2>')
    parts.append(table("Pending reviews per pool against the reviewers' cap",
                       ["Pool", "Pending", "Cap", "Oldest waits", "Waiting for the cap",
                        "State"], rows,
                       empty="no pending reviews", attrs='data-testid="review-caps"'))
    if caller.platform and caller.can("operate"):
        inner = ('<label for="cap-pool">Pool</label><input id="cap-pool" name="pool" required>'
                 '<label for="cap-n">Cap (empty: none)</label>'
                 '<input id="cap-n" name="cap" type="number" min="1" step="1">'
                 '<button type="submit">Set review cap</button>')
        parts.append(form("/console/review-caps", page.csrf, inner, attrs='class="inline"'))
    parts.append("</section>")

    # Tokens and cost per hour against the budget.
    hour = now.replace(minute=0, second=0, microsecond=0)
    hours = [hour - timedelta(hours=i) for i in range(23, -1, -1)]
    by_hour = {r["hour"]: r for r in data.spend}
    per_hour_budget = float(sum(int(b["tokens_per_minute"]) for b in data.budget) * 60)
    parts.append('<section aria-labelledby="spend"><h2 id="spend">Tokens and cost</h2>')
    if per_hour_budget:
        parts.append(f"<p>Budget: {per_hour_budget:,.0f} tokens per hour "
                     f"({len(data.budget)} provider and model pair(s)).</p>")
    else:
        parts.append("<p>No fleet token budget is configured "
                     "(<code>CALMQ_BUDGET_TOKENS_PER_MINUTE</code>).</p>")
    parts.append(bars("Tokens per hour, last 24 h", [h.strftime("%H:00") for h in hours],
                      [("tokens", [float(by_hour[h]["tokens"]) if h in by_hour else 0.0
                                   for h in hours])],
                      limit=per_hour_budget or None, limit_label="budget"))
    parts.append(table("Tokens and cost per hour (last 24 h)",
                       ["Hour", "Tokens", "Cost USD", "of it on retries", "of it on dead letters"],
                       [(when(r["hour"]), f"{r['tokens']:,}", f"{r['cost_usd']:.4f}",
                         f"{r['retry_cost_usd']:.4f}", f"{r['dead_letter_cost_usd']:.4f}")
                        for r in data.spend], empty="no model calls in the last 24 hours"))
    parts.append("</section>")

    # Lag: the relay's replication slots (fleet-wide: platform keys only).
    if caller.platform:
        slots = await replication_slots(request.app[STORE])
        parts.append('<section aria-labelledby="lag"><h2 id="lag">Lag</h2>')
        parts.append(table("Relay replication slots (WAL not yet streamed)",
                           ["Slot", "Active", "Retained bytes"],
                           [(s.slot, "yes" if s.active else "no", f"{s.retained_bytes:,}")
                            for s in slots], empty="no replication slots (polling relay)"))
        reader = request.app[CONSUMER_LAG]
        assert isinstance(reader, FleetLag)
        parts.append(lag_section(await reader.read(request.app[SETTINGS].kafka_bootstrap)))
        parts.append("</section>")
    parts.append(f'<p class="muted">Read at {when(now)}.</p>')
    return html_response(layout("Overview", "".join(parts), page, current="overview"))


@guard("operate")
async def set_review_cap(request: web.Request, caller: Tenant, page: Page) -> web.StreamResponse:
    if not caller.platform:
        raise ContractError("review caps are fleet-wide: set them with a platform key",
                            code="platform_key_required", status=403)
    form_data = await request.post()
    pool = str(form_data.get("pool", "")).strip()
    raw = str(form_data.get("cap", "")).strip()
    if not pool:
        raise ContractError("name the pool", code="invalid_form", status=422)
    try:
        cap = int(raw) if raw else None
    except ValueError as exc:
        raise ContractError("the cap is a whole number", code="invalid_form", status=422) from exc
    if cap is not None and cap < 1:
        raise ContractError("the cap is at least 1 (empty: no cap)", code="invalid_form",
                            status=422)
    await _reads(request).set_review_cap(pool, cap, caller.identity)
    return redirect("/console/overview")


# -- jobs ---------------------------------------------------------------------------------------

def _job_query(request: web.Request, caller: Tenant) -> JobQuery:
    params = request.query
    statuses = [s for s in params.getall("status", []) if s] or None
    if statuses and not set(statuses) <= set(_STATUSES):
        raise ContractError(f"status is one of {', '.join(_STATUSES)}", code="invalid_query")

    def text(name: str) -> str | None:
        value = params.get(name, "").strip()
        return value or None

    def at(name: str) -> datetime | None:
        value = text(name)
        return parse_time(name, value, zone_required=False) if value else None

    return JobQuery(tenant_id=scope(caller), statuses=statuses, workflow=text("workflow"),
                    pool=text("pool"), priority=text("priority"), lane=text("lane"),
                    created_after=at("created_after"),
                    created_before=at("created_before"), search=text("q"), limit=100)


def _job_json(job: ConsoleJob) -> dict[str, Any]:
    return {"job_id": str(job.id), "tenant": job.tenant, "workflow": job.workflow,
            "status": job.status, "priority": job.priority, "lane": job.lane,
            "pool": job.pool, "step": job.step,
            "attempt": job.attempt, "created_at": format_time(job.created_at),
            "updated_at": format_time(job.updated_at), "metadata": job.metadata}


@guard()
async def jobs_json(request: web.Request, caller: Tenant, page: Page) -> web.StreamResponse:
    rows = await _reads(request).jobs(_job_query(request, caller))
    return web.json_response({"jobs": [_job_json(j) for j in rows]})


@guard()
async def jobs_page(request: web.Request, caller: Tenant, page: Page) -> web.StreamResponse:
    query = _job_query(request, caller)
    rows = await _reads(request).jobs(query)
    params = request.query

    def select(name: str, label: str, options: list[str], chosen: list[str]) -> str:
        opts = "".join(f'<option value="{esc(o)}"{" selected" if o in chosen else ""}>'
                       f"{esc(o)}</option>" for o in options)
        return (f'<label for="f-{name}">{label}</label><select id="f-{name}" name="{name}">'
                f'<option value="">any</option>{opts}</select>')

    def field(name: str, label: str, kind: str = "text") -> str:
        return (f'<label for="f-{name}">{label}</label><input id="f-{name}" name="{name}" '
                f'type="{kind}" value="{esc(params.get(name, ""))}">')

    def choices(known: tuple[str, ...], chosen: str | None) -> list[str]:
        return [*known, *([chosen] if chosen and chosen not in known else [])]

    filters = ('<form method="get" action="/console/jobs" class="filters" role="search">'
               + select("status", "Status", _STATUSES, query.statuses or [])
               + select("workflow", "Workflow", sorted(request.app[WORKFLOWS].keys()),
                        [query.workflow] if query.workflow else [])
               + field("pool", "Pool")
               + select("priority", "Priority", choices(_PRIORITIES, query.priority),
                        [query.priority] if query.priority else [])
               + select("lane", "Lane", choices(_LANES, query.lane),
                        [query.lane] if query.lane else [])
               + field("created_after", "Created after", "datetime-local")
               + field("created_before", "Created before", "datetime-local")
               + field("q", "Job id or metadata value", "search")
               + '<button type="submit">Filter</button></form>')
    headers = ["Job", *(["Tenant"] if caller.platform else []), "Workflow", "Status",
               "Priority", "Lane", "Pool", "Step", "Attempt", "Created"]
    body_rows = []
    for j in rows:
        link = Markup(f'<a href="/console/jobs/{j.id}">{esc(str(j.id)[:8])}</a>')
        body_rows.append((link, *([j.tenant] if caller.platform else []), j.workflow,
                          _badge(j.status), j.priority, j.lane, j.pool, j.step, j.attempt,
                          when(j.created_at)))
    live = f"/console/jobs.json?{request.query_string}"
    body = (filters + table(f"{len(rows)} job(s), newest first (live)", headers, body_rows,
                            empty="no jobs match",
                            attrs=f'id="jobs" data-live="{esc(live)}" '
                                  f'data-platform="{int(caller.platform)}"'))
    return html_response(layout("Jobs", body, page, current="jobs"))


def lag_section(lags: list[GroupLag] | None) -> str:
    """Consumer lag per topic and group: a table and a bar chart (None: unavailable)."""
    if lags is None:
        return ('<p class="error" data-testid="consumer-lag">Consumer lag unavailable: the '
                "Kafka brokers did not answer in time.</p>")
    parts = [table("Kafka consumer lag per topic and group (messages not yet committed)",
                   ["Group", "Topic", "Partitions", "Lag"],
                   [(x.group, x.topic, x.partitions, f"{x.lag:,}") for x in lags],
                   empty="no calmq consumer group has committed offsets yet",
                   attrs='data-testid="consumer-lag"')]
    if lags:
        parts.append(bars("Consumer lag per topic", [f"{x.topic} ({x.group})" for x in lags],
                          [("messages behind", [float(x.lag) for x in lags])]))
    return "".join(parts)


def review_cap_state(pending: int, cap: int | None, held: int) -> str:
    """What the overview says of a pool's pending reviews against its cap."""
    if cap is None:
        return (f"no cap set: {held} held job(s) are being released" if held
                else "no cap set")
    if pending >= cap or held:
        return (f"past the cap ({pending} pending, cap {cap}): new jobs that need review "
                f"wait in queued until reviews are decided ({held} waiting)")
    return "within the cap"


def held_for_review_cap(events: list[dict[str, Any]]) -> bool:
    """Whether a job's newest wait (waiting / resumed events) is for its pool's review cap."""
    for e in reversed(events):
        if e["type"] in ("waiting", "resumed"):
            detail = e.get("detail") or {}
            return e["type"] == "waiting" and detail.get("reason") == "review_cap"
    return False


def _event_summary(event: dict[str, Any]) -> str:
    """What a person needs of an event's detail, in one line."""
    d = event.get("detail") or {}
    if not isinstance(d, dict):
        return str(d)
    bits = []
    error = d.get("error") if isinstance(d.get("error"), dict) else (
        d if "code" in d and "class" in d else None)
    if error:
        bits.append(f"{error.get('class')}/{error.get('code')}: {error.get('message', '')}")
    for key, label in (("step", "step"), ("pool", "pool"), ("delay_seconds", "retry in"),
                       ("retry_in_seconds", "retry in"), ("by", "by"), ("reviewer", "reviewer"),
                       ("decision", "decision"), ("reason", "reason"), ("fields", "fields"),
                       ("worker", "worker"), ("confidence", "confidence"),
                       ("input_tokens", "tokens in"), ("output_tokens", "tokens out"),
                       ("artifact", "artifact")):
        if key in d and d[key] is not None:
            value = d[key]
            bits.append(f"{label} {json.dumps(value) if isinstance(value, dict) else value}")
    return "; ".join(bits)


def _timeline_item(e: dict[str, Any]) -> str:
    return (f'<li data-type="{esc(e["type"])}"><span class="etype">{esc(e["type"])}</span> '
            f"{when(e['at'])} <span class=\"muted\">attempt {esc(e['attempt'])}</span> "
            f"<span>{esc(_event_summary(e))}</span></li>")


async def _preview(request: web.Request, uri: str, content_type: str | None) -> str:
    try:
        raw = await request.app[OBJECTS].get(uri)
    except (ContractError, OSError):
        return '<p class="muted">the object cannot be read now</p>'
    head = raw[:_PREVIEW_BYTES]
    if b"\0" in head or (content_type and not (content_type.startswith("text/")
                                               or "json" in content_type)):
        return f'<p class="muted">{len(raw):,} bytes of {esc(content_type)}: no preview</p>'
    text = head.decode("utf-8", "replace")
    if "json" in (content_type or "") or text.lstrip().startswith(("{", "[")):
        with contextlib.suppress(ValueError):
            text = json.dumps(json.loads(raw), indent=2)[:_PREVIEW_BYTES]
    more = "" if len(raw) <= _PREVIEW_BYTES else f" (first {_PREVIEW_BYTES:,} bytes)"
    return f'<pre class="preview" tabindex="0">{esc(text)}</pre><p class="muted">{more}</p>'


def _trace_id(trace_parent: str | None) -> str:
    parts = (trace_parent or "").split("-")
    return parts[1] if len(parts) == 4 else "-"


@guard()
async def job_page(request: web.Request, caller: Tenant, page: Page) -> web.StreamResponse:
    ident = _job_id(request)
    job = await _record(request, caller, ident)
    status = str(job["status"])
    after = await _reads(request).last_event_id(ident)
    parts: list[str] = []
    badge = Markup(_badge(status).replace("<span", '<span id="job-status"', 1))
    parts.append(f'<p>Status {badge} <span id="seen" class="muted"></span></p>')
    facts = [("Tenant", job["tenant"]),
             ("Workflow", f"{job['workflow']} v{job['workflow_version']}"),
             ("Step", job["step"]), ("Attempt", f"{job['attempt']} of {job['max_attempts']}"),
             ("Priority", job["priority"]), ("Lane", job["lane"]),
             ("Pool", job["pool"]),
             ("Created", when(job["created_at"])), ("Updated", when(job["updated_at"])),
             ("Deadline", when(job["deadline_at"])), ("Trace id", _trace_id(job["trace_parent"])),
             ("Tokens", f"{int(job['input_tokens'])} in, {int(job['output_tokens'])} out"),
             ("Cost", f"USD {float(job['cost_usd']):.6f}"),
             ("Metadata", json.dumps(job["metadata"]))]
    parts.append('<dl class="facts">' + "".join(f"<dt>{esc(k)}</dt><dd>{esc(v)}</dd>"
                                                for k, v in facts) + "</dl>")
    if status == "queued" and held_for_review_cap(job["events"]):
        parts.append('<p class="notice" data-testid="waiting-reason">Waiting (reason '
                     "<code>review_cap</code>): the pending reviews of pool "
                     f"{esc(job['pool'])} are at its review cap; this job runs by itself once "
                     "reviews are decided.</p>")
    parts.append(_decision(job, caller, page))
    if job.get("error"):
        e = job["error"]
        parts.append(f'<p class="error">Last error: {esc(e.get("class"))}/{esc(e.get("code"))}: '
                     f'{esc(e.get("message"))}</p>')

    parts.append('<section aria-labelledby="timeline-h"><h2 id="timeline-h">Timeline</h2>'
                 f'<ol id="timeline" data-job="{ident}" data-after="{after}" '
                 f'data-status="{esc(status)}" data-terminal="{int(status in TERMINAL)}" '
                 f'data-types="{esc(" ".join(t.value for t in EventType))}">'
                 + "".join(_timeline_item(e) for e in job["events"]) + "</ol></section>")
    attempts = []
    for a in job["attempts"]:
        started = _parse(a.get("started_at"))
        finished = _parse(a.get("finished_at"))
        model_time = (f"{(finished - started).total_seconds():.2f} s"
                      if started and finished else "-")
        error = (f"{a.get('error_class')}/{a.get('error_code')}: {a.get('error_message') or ''}"
                 if a.get("error_code") else "")
        attempts.append((a.get("round", 0), a.get("step"), a.get("attempt"), a.get("worker"),
                         when(started), a.get("outcome") or "running", error,
                         f"{a.get('input_tokens', 0)}+{a.get('output_tokens', 0)}",
                         f"{float(a.get('cost_usd') or 0):.6f}", model_time))
    parts.append(table("Attempts (round 0 is the current one; a redrive starts a new round)",
                       ["Round", "Step", "Attempt", "Worker", "Started", "Outcome", "Error",
                        "Tokens", "Cost USD", "Time"], attempts, empty="no attempts yet"))

    parts.append('<section aria-labelledby="input-h"><h2 id="input-h">Input</h2>')
    if job.get("input") is not None:
        parts.append(f'<pre class="preview" tabindex="0">{esc(json.dumps(job["input"], indent=2))}'
                     "</pre>")
    elif job.get("input_ref"):
        ref = str(job["input_ref"])
        parts.append(f"<p>Reference <code>{esc(ref)}</code></p>")
        if tenant_owns(request.app[SETTINGS].object_store_url, job["tenant_id"], ref):
            parts.append(await _preview(request, ref, None))
            parts.append(f'<p><a href="/console/jobs/{ident}/input" download>Download the input'
                         "</a></p>")
    else:
        parts.append('<p class="muted">no input (purged)</p>')
    parts.append("</section>")
    parts.append('<section aria-labelledby="artifact-h"><h2 id="artifact-h">Artifact</h2>')
    artifact = job.get("artifact")
    if artifact:
        parts.append(await _preview(request, str(artifact["uri"]), artifact.get("content_type")))
        parts.append(f'<p><a href="/console/jobs/{ident}/artifact" download>Download the '
                     f"artifact ({esc(artifact.get('size'))} bytes)</a></p>")
    else:
        parts.append('<p class="muted">none yet</p>')
    parts.append("</section>")
    title = f"Job {str(ident)[:8]}"
    return html_response(layout(title, "".join(parts), page, current="jobs"))


def _parse(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return None


def _decision(job: dict[str, Any], caller: Tenant, page: Page) -> str:
    """The decision the job needs now, with its button (if the key may take it)."""
    ident = job["id"]
    status = job["status"]
    out = ['<section aria-labelledby="decision-h" class="card" id="decision">'
           '<h2 id="decision-h">Decision needed</h2>']
    if status == Status.AWAITING_REVIEW:
        deadline = job.get("review_deadline_at")
        out.append(f"<p>A person reviews this job (deadline {when(deadline)}).</p>")
        if caller.can("review"):
            out.append(f'<p><a class="button" href="/console/reviews/{ident}">Review it</a></p>')
    elif status == Status.DEAD_LETTER:
        out.append("<p>The job is a dead letter: fix the cause, then redrive it.</p>")
        if caller.can("operate"):
            inner = (f'<input type="hidden" name="job_id" value="{ident}">'
                     '<label for="reason">Reason</label>'
                     '<input id="reason" name="reason" required>'
                     '<button type="submit">Redrive&hellip;</button>')
            out.append(form("/console/dead-letters/redrive", page.csrf, inner))
    elif status not in TERMINAL:
        out.append(f"<p>The job is {esc(status)}.</p>")
        if caller.can("submit") or caller.can("operate"):
            out.append(form(f"/console/jobs/{ident}/cancel", page.csrf,
                            '<button type="submit" class="danger">Cancel the job</button>'))
    else:
        out.append(f"<p>None: the job is {esc(status)}.</p>")
    out.append("</section>")
    return "".join(out)


@guard()
async def job_json(request: web.Request, caller: Tenant, page: Page) -> web.StreamResponse:
    ident = _job_id(request)
    job = await _record(request, caller, ident)
    return web.json_response(json.loads(json.dumps({
        "job_id": str(ident), "tenant": job["tenant"], "status": job["status"],
        "workflow": job["workflow"], "step": job["step"], "artifact": job["artifact"],
        "error": job["error"], "events": job["events"]}, default=str)))


@guard()
async def job_input(request: web.Request, caller: Tenant, page: Page) -> web.StreamResponse:
    ident = _job_id(request)
    job = await _record(request, caller, ident)
    ref = job.get("input_ref")
    if job.get("input") is not None:
        return web.Response(body=json.dumps(job["input"]).encode(),
                            content_type="application/json")
    if not ref or not tenant_owns(request.app[SETTINGS].object_store_url, job["tenant_id"],
                                  str(ref)):
        raise NotFound("the job has no input in its tenant's objects", code="input_not_found")
    raw = await request.app[OBJECTS].get(str(ref))
    return web.Response(body=raw, content_type="application/octet-stream", headers={
        "Content-Disposition": f'attachment; filename="{ident}-input"'})


@guard()
async def job_artifact(request: web.Request, caller: Tenant, page: Page) -> web.StreamResponse:
    """The artifact's bytes (for a platform key too, which /v1 scopes to its own tenant)."""
    ident = _job_id(request)
    job = await _record(request, caller, ident)
    artifact = job.get("artifact")
    if not artifact:
        raise NotFound(f"the job is {job['status']} and has no artifact",
                       code="artifact_not_found")
    raw = await request.app[OBJECTS].get(str(artifact["uri"]))
    return web.Response(body=raw, headers={
        "Content-Type": str(artifact.get("content_type") or "application/octet-stream"),
        "Content-Disposition": f'attachment; filename="{ident}-artifact"'})


@guard("submit", "operate")
async def cancel(request: web.Request, caller: Tenant, page: Page) -> web.StreamResponse:
    ident = _job_id(request)
    job = await _record(request, caller, ident)
    if not await request.app[STORE].jobs.cancel(job["tenant_id"], ident, by=caller.identity):
        raise ContractError(f"the job is {job['status']} already", code="job_terminal",
                            status=409)
    return redirect(f"/console/jobs/{ident}")


# -- reviews ------------------------------------------------------------------------------------

@guard("review")
async def reviews_json(request: web.Request, caller: Tenant, page: Page) -> web.StreamResponse:
    rows = await _reads(request).reviews(scope(caller))
    return web.json_response({"reviews": [
        {"job_id": str(r.id), "tenant": r.tenant, "workflow": r.workflow, "step": r.step,
         "confidence": r.confidence, "output": r.output,
         "requested_at": format_time(r.updated_at),
         "deadline_at": format_time(r.review_deadline_at)} for r in rows]})


@guard("review")
async def reviews_page(request: web.Request, caller: Tenant, page: Page) -> web.StreamResponse:
    rows = await _reads(request).reviews(scope(caller))
    now = datetime.now(UTC)
    items = []
    for r in rows:
        left = ((r.review_deadline_at - now).total_seconds() if r.review_deadline_at else None)
        link = Markup(f'<a href="/console/reviews/{r.id}" class="review-link">'
                      f"{esc(str(r.id)[:8])}</a>")
        items.append((link, *([r.tenant] if caller.platform else []), r.workflow, r.step,
                      f"{r.confidence:.2f}" if r.confidence is not None else "-",
                      when(r.updated_at), when(r.review_deadline_at),
                      "overdue" if left is not None and left < 0 else
                      ago(left) if left is not None else "-"))
    done = request.query.get("done", "")
    body = ('<p class="muted">Keyboard: <kbd>j</kbd>/<kbd>k</kbd> move, <kbd>Enter</kbd> opens; '
            "on a review <kbd>a</kbd> approves, <kbd>r</kbd> goes to the reason.</p>"
            + table(f"{len(rows)} pending review(s), oldest first",
                    ["Job", *(["Tenant"] if caller.platform else []), "Workflow", "Step",
                     "Confidence", "Waiting since", "Deadline", "Time left"], items,
                    empty="no reviews waiting", attrs='id="review-queue"'))
    return html_response(layout("Review queue", body, page, current="reviews",
                                status=f"Review {done}." if done in ("approved", "rejected")
                                else ""))


def _output_fields(model: type[BaseModel] | None, output: dict[str, Any]
                   ) -> list[tuple[str, str, Any, bool]]:
    """(name, kind, value, required) of each field a reviewer may correct: the step's
    output model's fields (or, without a model, the output's own keys)."""
    if model is None:
        return [(k, "json", v, False) for k, v in output.items()]
    schema = model.model_json_schema()
    required = set(schema.get("required", []))
    found = []
    for name, prop in schema.get("properties", {}).items():
        kinds = {prop.get("type")} | {p.get("type") for p in prop.get("anyOf", [])}
        kind = ("number" if "number" in kinds else "integer" if "integer" in kinds
                else "boolean" if "boolean" in kinds else "string" if kinds <= {"string", None}
                else "json")
        found.append((name, kind, output.get(name), name in required))
    return found


def _field_input(name: str, kind: str, value: Any, required: bool) -> str:
    ident = f"field-{name}"
    label = f'<label for="{ident}">{esc(name)}{" (required)" if required else ""}</label>'
    if kind == "boolean":
        checked = " checked" if value else ""
        return (f'<div class="field">{label}<input type="checkbox" id="{ident}" '
                f'name="field:{esc(name)}" value="true"{checked}>'
                f'<input type="hidden" name="present:{esc(name)}" value="1"></div>')
    if kind == "json":
        text = "" if value is None else json.dumps(value, indent=2)
        return (f'<div class="field">{label}<textarea id="{ident}" name="field:{esc(name)}" '
                f'rows="3" data-kind="json">{esc(text)}</textarea></div>')
    attrs = {"number": 'type="number" step="any"', "integer": 'type="number" step="1"'}.get(
        kind, 'type="text"')
    shown = "" if value is None else value
    return (f'<div class="field">{label}<input id="{ident}" name="field:{esc(name)}" {attrs} '
            f'value="{esc(shown)}" data-kind="{kind}"></div>')


def _corrections(fields: list[tuple[str, str, Any, bool]], form_data: Any
                 ) -> dict[str, Any]:
    """The fields the reviewer changed, typed as the output model's fields are."""
    changed: dict[str, Any] = {}
    for name, kind, old, _required in fields:
        key = f"field:{name}"
        if kind == "boolean":
            if f"present:{name}" not in form_data:
                continue
            value: Any = key in form_data
        else:
            if key not in form_data:
                continue
            raw = str(form_data[key])
            if kind == "string":
                value = raw
            elif raw.strip() == "":
                value = None
            else:
                try:
                    value = (json.loads(raw) if kind == "json" else
                             int(raw) if kind == "integer" else float(raw))
                except ValueError as exc:
                    raise ContractError(f"{name}: not a valid {kind}", code="invalid_fields",
                                        status=422) from exc
        if value != old and not (value in (None, "") and old is None):
            changed[name] = value
    return changed


@guard("review")
async def review_page(request: web.Request, caller: Tenant, page: Page) -> web.StreamResponse:
    return await _review_form(request, caller, page)


async def _review_form(request: web.Request, caller: Tenant, page: Page, error: str = "",
                       status: int = 200) -> web.StreamResponse:
    ident = _job_id(request)
    job = await _record(request, caller, ident)
    if job["status"] != Status.AWAITING_REVIEW:
        raise ContractError(f"the job is {job['status']}, not awaiting review",
                            code="not_awaiting_review", status=409)
    reviews = await _reads(request).reviews(scope(caller), limit=1000)
    mine = next((r for r in reviews if r.id == ident), None)
    if mine is None:
        raise NotFound("no such review")
    workflow = request.app[WORKFLOWS].get(mine.workflow)
    model = workflow.step(mine.step).output_model if workflow is not None else None
    fields = _output_fields(model, mine.output)
    left = ""
    if mine.review_deadline_at is not None:
        secs = (mine.review_deadline_at - datetime.now(UTC)).total_seconds()
        left = "overdue" if secs < 0 else f"{ago(secs)} left"
    alert = f'<p class="error" role="alert" data-code="invalid_fields">{esc(error)}</p>' \
        if error else ""
    if mine.input is not None:
        input_html = (f'<pre class="preview" tabindex="0">{esc(json.dumps(mine.input, indent=2))}'
                      "</pre>")
    elif mine.input_ref and tenant_owns(request.app[SETTINGS].object_store_url, mine.tenant_id,
                                        mine.input_ref):
        input_html = await _preview(request, mine.input_ref, None)
    else:
        input_html = '<p class="muted">no input to show</p>'
    approve = (form(f"/console/reviews/{ident}", page.csrf,
                    '<fieldset><legend>Correct the fields, then approve</legend>'
                    + "".join(_field_input(*f) for f in fields)
                    + '<input type="hidden" name="decision" value="approve">'
                    '<button type="submit" id="approve" accesskey="a">Approve</button>'
                    "</fieldset>", attrs='id="approve-form"'))
    reject = form(f"/console/reviews/{ident}", page.csrf,
                  '<fieldset><legend>Or reject it (the job dead-letters)</legend>'
                  '<label for="reason">Reason</label>'
                  '<textarea id="reason" name="reason" rows="2" required></textarea>'
                  '<input type="hidden" name="decision" value="reject">'
                  '<button type="submit" class="danger" id="reject">Reject</button></fieldset>',
                  attrs='id="reject-form"')
    body = (f"{alert}<p>{esc(mine.workflow)} &middot; step {esc(mine.step)} &middot; confidence "
            f"{mine.confidence if mine.confidence is not None else '-'} &middot; deadline "
            f"{when(mine.review_deadline_at)} ({esc(left)}) &middot; "
            f'<a href="/console/jobs/{ident}">the job</a></p>'
            '<div class="side-by-side">'
            f'<section aria-labelledby="in-h"><h2 id="in-h">Input</h2>{input_html}</section>'
            '<section aria-labelledby="out-h"><h2 id="out-h">Model output</h2>'
            f'<pre class="preview" tabindex="0">{esc(json.dumps(mine.output, indent=2))}</pre>'
            "</section></div>" + approve + reject)
    return html_response(layout(f"Review {str(ident)[:8]}", body, page, current="reviews"),
                         status)


@guard("review")
async def decide(request: web.Request, caller: Tenant, page: Page) -> web.StreamResponse:
    ident = _job_id(request)
    form_data = await request.post()
    job = await _record(request, caller, ident)
    choice = str(form_data.get("decision", ""))
    if choice not in ("approve", "reject"):
        raise ContractError("decision is approve or reject", code="invalid_form", status=422)
    corrections: dict[str, Any] = {}
    if choice == "approve":
        workflow = request.app[WORKFLOWS].get(job["workflow"])
        model = workflow.step(job["step"]).output_model if workflow is not None else None
        reviews = await _reads(request).reviews(scope(caller), limit=1000)
        mine = next((r for r in reviews if r.id == ident), None)
        if mine is None:
            raise ContractError(f"the job is {job['status']}, not awaiting review",
                                code="not_awaiting_review", status=409)
        try:
            corrections = _corrections(_output_fields(model, mine.output), form_data)
        except ContractError as exc:
            return await _review_form(request, caller, page, exc.message, 422)
    reason = _field_value(str(form_data.get("reason", "")))
    if choice == "reject" and reason is None:
        return await _review_form(request, caller, page, "a rejection needs a reason", 422)
    desk = ReviewDesk(request.app[STORE], request.app[WORKFLOWS], request.app[OBJECTS])
    try:
        await desk.decide(job["tenant_id"], ident,
                          Decision(choice, caller.identity, corrections, reason))  # type: ignore[arg-type]
    except ContractError as exc:
        if exc.code != "invalid_fields":
            raise
        # The same form again, with the API's invalid_fields message and status.
        return await _review_form(request, caller, page, exc.message, 422)
    # On to the next review in the queue, the way a reviewer works through it.
    rest = await _reads(request).reviews(scope(caller), limit=1)
    done = "approved" if choice == "approve" else "rejected"
    if rest:
        return redirect(f"/console/reviews/{rest[0].id}?done={done}")
    return redirect(f"/console/reviews?done={done}")


# -- dead letters -------------------------------------------------------------------------------

def _group_key(d: DeadLetter) -> tuple[str, str, str, str]:
    e = d.error or {}
    return (d.workflow, d.step, str(e.get("class", "")), str(e.get("code", "")))


@guard("operate")
async def dead_letters_json(request: web.Request, caller: Tenant, page: Page
                            ) -> web.StreamResponse:
    groups = await _dead(request).summary(DeadLetterFilter(tenant_id=scope(caller)))
    return web.json_response({"groups": [
        {"workflow": g.workflow, "step": g.step, "failure_class": g.failure_class,
         "code": g.code, "count": g.count, "first_seen": format_time(g.oldest),
         "last_seen": format_time(g.newest)} for g in groups]})


def _group_url(workflow: str, step: str, failure_class: str | None, code: str | None) -> str:
    from urllib.parse import urlencode

    return "/console/dead-letters/group?" + urlencode(
        {"workflow": workflow, "step": step, "failure_class": failure_class or "",
         "code": code or ""})


@guard("operate")
async def dead_letters_page(request: web.Request, caller: Tenant, page: Page
                            ) -> web.StreamResponse:
    groups = await _dead(request).summary(DeadLetterFilter(tenant_id=scope(caller)))
    rows = []
    for g in groups:
        key = f"{g.workflow}|{g.step}|{g.failure_class}|{g.code}"
        link = Markup(f'<a href="{esc(_group_url(g.workflow, g.step, g.failure_class, g.code))}">'
                      "Open</a>")
        rows.append((g.failure_class, g.code, g.workflow, g.step,
                     Markup(f'<span class="count" data-group="{esc(key)}">{g.count}</span>'),
                     when(g.oldest), when(g.newest), link))
    done = request.query.get("done", "")
    body = table("Dead letters by failure class and code (live)",
                 ["Class", "Code", "Workflow", "Step", "Jobs", "First seen", "Last seen", ""],
                 rows, empty="no dead letters", attrs='id="dead-groups" '
                                                      'data-live="/console/dead-letters.json"')
    return html_response(layout("Dead letters", body, page, current="dead-letters",
                                status=f"{done} job(s) redriven." if done.isdigit() else ""))


async def _group_rows(request: web.Request, caller: Tenant) -> list[DeadLetter]:
    params = request.query
    where = DeadLetterFilter(tenant_id=scope(caller),
                             failure_class=params.get("failure_class") or None,
                             code=params.get("code") or None,
                             workflow=params.get("workflow") or None, limit=1000)
    rows = await _dead(request).find(where)
    step = params.get("step")
    return [r for r in rows if not step or r.step == step]


@guard("operate")
async def dead_letter_group(request: web.Request, caller: Tenant, page: Page
                            ) -> web.StreamResponse:
    rows = await _group_rows(request, caller)
    params = request.query
    items = []
    for r in rows:
        box = Markup(f'<input type="checkbox" name="job_id" value="{r.id}" checked '
                     f'aria-label="select job {r.id}" class="pick">')
        message = (r.error or {}).get("message", "")
        items.append((box, Markup(f'<a href="/console/jobs/{r.id}">{esc(str(r.id)[:8])}</a>'),
                      *([r.tenant] if caller.platform else []), r.attempt, message,
                      when(r.dead_lettered_at)))
    title = (f"{params.get('failure_class') or '?'} / {params.get('code') or '?'} in "
             f"{params.get('workflow') or 'any workflow'}")
    inner = ('<p><label><input type="checkbox" id="pick-all" checked> Select all</label></p>'
             + table(f"{len(rows)} dead letter(s)",
                     ["", "Job", *(["Tenant"] if caller.platform else []), "Attempts", "Error",
                      "Dead since"], items, empty="none left in this group")
             + '<label for="reason">Reason for the redrive</label>'
             '<input id="reason" name="reason" required>'
             '<button type="submit">Redrive selected&hellip;</button>')
    body = (f"<p>{esc(title)}</p>"
            + form("/console/dead-letters/redrive", page.csrf, inner, attrs='id="redrive-form"'))
    return html_response(layout("Dead-letter group", body, page, current="dead-letters"))


@guard("operate")
async def redrive(request: web.Request, caller: Tenant, page: Page) -> web.StreamResponse:
    form_data = await request.post()
    try:
        ids = list(dict.fromkeys(uuid.UUID(str(v)) for v in form_data.getall("job_id", [])))
    except ValueError as exc:
        raise ContractError("a job_id is not a job id", code="invalid_form", status=422) from exc
    reason = _field_value(str(form_data.get("reason", "")))
    if not ids:
        raise ContractError("select at least one dead letter", code="invalid_form", status=422)
    if reason is None:
        raise ContractError("a redrive needs a reason", code="redrive_needs_reason", status=422)
    if form_data.get("confirm") != "yes":
        hidden = "".join(f'<input type="hidden" name="job_id" value="{i}">' for i in ids)
        inner = (hidden + f'<input type="hidden" name="reason" value="{esc(reason)}">'
                 '<input type="hidden" name="confirm" value="yes">'
                 f'<button type="submit" id="confirm">Redrive {len(ids)} job(s)</button> '
                 '<a href="/console/dead-letters">Cancel</a>')
        body = (f'<p role="alert" data-testid="confirm-count">Redrive <strong>{len(ids)}</strong>'
                f" dead letter(s) with the reason &ldquo;{esc(reason)}&rdquo;? Each goes back to "
                "its queue with a fresh attempt budget.</p>"
                + form("/console/dead-letters/redrive", page.csrf, inner))
        return html_response(layout("Confirm the redrive", body, page, current="dead-letters"))
    outcomes = await _dead(request).redrive(ids, by=caller.identity, reason=reason,
                                            tenant_id=scope(caller))
    redriven = sum(1 for o in outcomes if o.outcome == "redriven")
    others = [o for o in outcomes if o.outcome != "redriven"]
    if others:
        body = (f"<p>{redriven} redriven.</p>"
                + table("Not redriven", ["Job", "Outcome", "Code", "Message"],
                        [(str(o.job_id), o.outcome, o.code, o.message) for o in others]))
        return html_response(layout("Redrive", body, page, current="dead-letters"), 409)
    if len(ids) == 1:
        return redirect(f"/console/jobs/{ids[0]}")
    return redirect(f"/console/dead-letters?done={redriven}")


# -- static files -------------------------------------------------------------------------------

_TYPES = {".css": "text/css", ".js": "text/javascript"}


async def static(request: web.Request) -> web.StreamResponse:
    from importlib import resources

    name = request.match_info["name"]
    suffix = name[name.rfind("."):] if "." in name else ""
    if "/" in name or suffix not in _TYPES:
        raise NotFound("no such file", code="no_route")
    entry = resources.files(__package__).joinpath("static", name)
    if not entry.is_file():
        raise NotFound("no such file", code="no_route")
    return web.Response(body=entry.read_bytes(), content_type=_TYPES[suffix],
                        headers={"Cache-Control": "max-age=300"})


_UUID = "[0-9a-fA-F-]{36}"

HANDLERS: tuple[tuple[str, str, Any], ...] = (
    ("GET", "/console", index),
    ("GET", "/console/", index),
    ("GET", "/console/sign-in", sign_in_form),
    ("POST", "/console/sign-in", sign_in),
    ("POST", "/console/sign-out", sign_out),
    ("GET", "/console/overview", overview),
    ("POST", "/console/review-caps", set_review_cap),
    ("GET", "/console/jobs", jobs_page),
    ("GET", "/console/jobs.json", jobs_json),
    ("GET", "/console/jobs/{job_id:" + _UUID + "}.json", job_json),
    ("GET", "/console/jobs/{job_id:" + _UUID + "}", job_page),
    ("GET", "/console/jobs/{job_id}/input", job_input),
    ("GET", "/console/jobs/{job_id}/artifact", job_artifact),
    ("POST", "/console/jobs/{job_id}/cancel", cancel),
    ("GET", "/console/reviews", reviews_page),
    ("GET", "/console/reviews.json", reviews_json),
    ("GET", "/console/reviews/{job_id}", review_page),
    ("POST", "/console/reviews/{job_id}", decide),
    ("GET", "/console/dead-letters", dead_letters_page),
    ("GET", "/console/dead-letters.json", dead_letters_json),
    ("GET", "/console/dead-letters/group", dead_letter_group),
    ("POST", "/console/dead-letters/redrive", redrive),
    ("GET", "/console/static/{name}", static),
)
