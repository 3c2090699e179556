"""Data shaping for the console's templates: records in, what a page shows out.

Pure functions (no I/O, no HTML but the SVG charts): the overview's sections and charts, a
history entry's one-line summary, whether a job waits for its pool's review cap, the rows
of a job's attempts, an object preview, and the review form's fields and corrections.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel

from calmq import holds
from calmq.data.operations import JobCosts
from calmq.errors import ContractError
from calmq.lag import GroupLag
from calmq.producers.console.charts import bars
from calmq.producers.console.forms import checked
from calmq.producers.console.templates import ago

__all__ = ["Field", "Preview", "attempt_rows", "corrections", "event_summary",
           "held_for_review_cap", "lag_view", "output_fields", "overview_view", "preview",
           "providers_view", "review_cap_state", "trace_id", "waiting_notice"]

PREVIEW_BYTES = 4096


# -- overview -----------------------------------------------------------------------------

def providers_view(states: Sequence[Any], unpriced: Sequence[tuple[str, str]], *,
                   platform: bool, now: datetime) -> dict[str, Any]:
    """The overview's providers section: each provider and model blocked fleet-wide (a bad
    key, a missing permission, a model the account cannot use, billing: its jobs wait
    queued) or paused by a rate limit, with the reason; and the models with no price (their
    calls are costed at 0). The provider's own message is a platform key's only (it may
    name the account)."""
    blocked = []
    for s in states:
        if s.blocked_reason is not None:
            since = ago((now - s.blocked_at).total_seconds()) if s.blocked_at else "-"
            blocked.append([s.provider.split(":", 1)[0], s.model, s.blocked_reason,
                            f"{since} ago" if s.blocked_at else since,
                            (s.blocked_message or "")[:300] if platform else "-"])
        elif s.paused_seconds > 0:
            blocked.append([s.provider.split(":", 1)[0], s.model,
                            f"rate limited: paused {s.paused_seconds:.1f} s more", "-", "-"])
    return {"blocked_providers": blocked,
            "unpriced_models": [[kind, model] for kind, model in unpriced]}


def overview_view(*, backlog: Sequence[Mapping[str, Any]], outcomes: Sequence[Mapping[str, Any]],
                  spend: Sequence[Mapping[str, Any]], budget: Sequence[Mapping[str, Any]],
                  review_caps: Mapping[str, int], review_cap_held: Mapping[str, int],
                  now: datetime) -> dict[str, Any]:
    """The overview's sections: backlog and queue age, throughput, reviews against their
    caps, tokens and cost against the budget."""
    waiting = [r for r in backlog if r["status"] in ("queued", "retrying")]
    pools = sorted({str(r["pool"]) for r in backlog})
    series = [(status, [float(sum(r["jobs"] for r in backlog
                                  if r["pool"] == p and r["status"] == status))
                        for p in pools])
              for status in ("queued", "retrying", "running", "awaiting_review")]

    # Every 5-minute bin of the hour, empty ones too, so the chart reads as a time axis.
    last = now.replace(minute=now.minute - now.minute % 5, second=0, microsecond=0)
    bins = [last - timedelta(minutes=5 * i) for i in range(11, -1, -1)]
    done = [float(sum(r["jobs"] for r in outcomes if r["bin"] == b
                      and r["type"] == "completed")) for b in bins]
    dead = [float(sum(r["jobs"] for r in outcomes if r["bin"] == b
                      and r["type"] == "dead_lettered")) for b in bins]
    total = sum(done) + sum(dead)

    pending: dict[str, int] = {}
    wait: dict[str, float] = {}
    for r in backlog:
        if r["status"] == "awaiting_review":
            pending[str(r["pool"])] = int(r["jobs"])
            wait[str(r["pool"])] = float(r["oldest_seconds"])
    review_rows = []
    for pool in sorted(set(pending) | set(review_caps) | set(review_cap_held)):
        cap = review_caps.get(pool)
        n = pending.get(pool, 0)
        held = review_cap_held.get(pool, 0)
        review_rows.append([pool, n, cap if cap is not None else "none",
                            ago(wait.get(pool, 0.0)) if n else "-", held,
                            review_cap_state(n, cap, held)])

    hour = now.replace(minute=0, second=0, microsecond=0)
    hours = [hour - timedelta(hours=i) for i in range(23, -1, -1)]
    by_hour = {r["hour"]: r for r in spend}
    per_hour_budget = float(sum(int(b["tokens_per_minute"]) for b in budget) * 60)
    return {
        "backlog": [[r["pool"], r["priority"], r["lane"], r["status"], r["jobs"],
                     ago(r["oldest_seconds"])] for r in backlog],
        "backlog_chart": bars("Backlog per pool", pools, series) if pools else None,
        "oldest_wait": ago(max((r["oldest_seconds"] for r in waiting), default=0.0)),
        "completed": sum(done), "dead_lettered": sum(dead),
        "dead_letter_rate": sum(dead) / total if total else 0.0,
        "throughput_chart": bars("Jobs finished per 5 minutes",
                                 [b.strftime("%H:%M") for b in bins],
                                 [("completed", done), ("dead-lettered", dead)]),
        "reviews": review_rows,
        "per_hour_budget": per_hour_budget, "budget_pairs": len(budget),
        "spend_chart": bars("Tokens per hour, last 24 h", [h.strftime("%H:00") for h in hours],
                            [("tokens", [float(by_hour[h]["tokens"]) if h in by_hour else 0.0
                                         for h in hours])],
                            limit=per_hour_budget or None, limit_label="budget"),
        "spend": [[r["hour"], f"{r['tokens']:,}", f"{r['cost_usd']:.4f}",
                   f"{r['retry_cost_usd']:.4f}", f"{r['dead_letter_cost_usd']:.4f}"]
                  for r in spend],
    }


def lag_view(lags: Sequence[GroupLag] | None) -> dict[str, Any] | None:
    """Consumer lag per topic and group: rows and a bar chart (None: unavailable)."""
    if lags is None:
        return None
    return {"rows": [[x.group, x.topic, x.partitions, f"{x.lag:,}"] for x in lags],
            "chart": bars("Consumer lag per topic", [f"{x.topic} ({x.group})" for x in lags],
                          [("messages behind", [float(x.lag) for x in lags])])
            if lags else None}


def review_cap_state(pending: int, cap: int | None, held: int) -> str:
    """What the overview says of a pool's pending reviews against its cap."""
    if cap is None:
        return (f"no cap set: {held} held job(s) are being released" if held
                else "no cap set")
    if pending >= cap or held:
        return (f"past the cap ({pending} pending, cap {cap}): new jobs that need review "
                f"wait in queued until reviews are decided ({held} waiting)")
    return "within the cap"


# -- a job ----------------------------------------------------------------------------------

def held_for_review_cap(events: Sequence[Any]) -> bool:
    """Whether a job's newest wait (waiting / resumed events) is for its pool's review cap."""
    for e in reversed(events):
        kind = _get(e, "type")
        if kind in ("waiting", "resumed"):
            detail = _get(e, "detail") or {}
            return kind == "waiting" and detail.get("reason") == "review_cap"
    return False


def waiting_notice(events: Sequence[Any]) -> dict[str, str] | None:
    """Why a waiting job waits, for its page: its newest ``waiting`` event not followed by
    ``resumed`` (or its ``children_spawned`` not followed by ``children_joined``), in the
    sentence the holds registry (calmq.holds) gives its reason; None if it does not wait, or
    if its reason has a notice of its own (the review cap)."""
    for e in reversed(events):
        kind = _get(e, "type")
        if kind in ("resumed", "children_joined"):
            return None
        if kind not in ("waiting", "children_spawned"):
            continue
        d = _get(e, "detail") or {}
        # a step started child jobs: docs/how-to/fan-out.md
        reason = "children" if kind == "children_spawned" else str(d.get("reason", ""))
        text = holds.notice(reason, d)
        return None if text is None else {"reason": reason, "text": text}
    return None


def _get(record: Any, name: str) -> Any:
    return record[name] if isinstance(record, Mapping) else getattr(record, name)


def event_summary(detail: Any) -> str:
    """What a person needs of an event's detail, in one line."""
    d = detail or {}
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
    missed = d.get("deadline_missed")
    if isinstance(missed, dict):
        bits.append(f"deadline missed by {missed.get('late_seconds')} s")
    tiers = [t for t in d.get("tiers") or () if isinstance(t, dict)]
    if tiers:  # each call's service tier (calmq.calls.tiers): chosen, served, and a move
        bits.append("tiers " + ", ".join(
            f"{t.get('chosen')}->{t.get('served')}"
            + (f" ({t['moved']})" if t.get("moved") else "") for t in tiers))
    return "; ".join(bits)


def trace_id(trace_parent: str | None) -> str:
    parts = (trace_parent or "").split("-")
    return parts[1] if len(parts) == 4 else "-"


def attempt_rows(attempts: Sequence[tuple[int, Mapping[str, Any]]]) -> list[list[Any]]:
    """The attempts table: round, step, attempt, worker, started, outcome, error, tokens,
    cost, time."""
    rows = []
    for round_, a in attempts:
        started = _parse(a.get("started_at"))
        finished = _parse(a.get("finished_at"))
        took = (f"{(finished - started).total_seconds():.2f} s"
                if started and finished else "-")
        error = (f"{a.get('error_class')}/{a.get('error_code')}: {a.get('error_message') or ''}"
                 if a.get("error_code") else "")
        rows.append([round_, a.get("step"), a.get("attempt"), a.get("worker"), started,
                     a.get("outcome") or "running", error,
                     f"{a.get('input_tokens', 0)}+{a.get('output_tokens', 0)}",
                     f"{float(a.get('cost_usd') or 0):.6f}", took])
    return rows


def _parse(value: Any) -> datetime | None:
    if value is None or isinstance(value, datetime):
        return value
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class Preview:
    """What a page shows of an object: its first bytes as text, or why not."""

    text: str | None  # None: no preview (binary, or unreadable now)
    note: str  # "" or what the text is (a prefix), or why there is none


def preview(head: bytes | None, size: int | None, content_type: str | None) -> Preview:
    """A preview of an object from its first bytes (``head``: at most PREVIEW_BYTES+1 of
    them were read; None: the object cannot be read now) and its size."""
    if head is None:
        return Preview(None, "the object cannot be read now")
    textual = not content_type or content_type.startswith("text/") or "json" in content_type
    if b"\0" in head[:PREVIEW_BYTES] or not textual:
        shown = f"{size:,} bytes" if size is not None else "the object"
        return Preview(None, f"{shown} of {content_type or 'unknown type'}: no preview")
    whole = size is not None and size <= PREVIEW_BYTES and len(head) <= PREVIEW_BYTES
    text = head[:PREVIEW_BYTES].decode("utf-8", "replace")
    if whole and ("json" in (content_type or "") or text.lstrip().startswith(("{", "["))):
        with contextlib.suppress(ValueError):
            text = json.dumps(json.loads(text), indent=2)[:PREVIEW_BYTES]
    more = "" if whole else f"first {PREVIEW_BYTES:,} bytes" + (
        f" of {size:,}" if size is not None else "")
    return Preview(text, more)


def since(at: datetime | None, now: datetime | None = None) -> float | None:
    """Seconds from now until ``at`` (negative: past)."""
    if at is None:
        return None
    return (at - (now or datetime.now(UTC))).total_seconds()


# -- the review form ------------------------------------------------------------------------

Field = tuple[str, str, Any, bool]  # name, kind, value, required


def output_fields(model: type[BaseModel] | None, output: Mapping[str, Any]) -> list[Field]:
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


def field_text(kind: str, value: Any) -> str:
    """A field's value as the form shows it."""
    if value is None:
        return ""
    if kind == "json":
        return json.dumps(value, indent=2)
    return str(value)


def corrections(fields: Sequence[Field], form: Mapping[str, Any]) -> dict[str, Any]:
    """The fields the reviewer changed, typed as the output model's fields are; text that
    cannot be stored is refused (invalid_form) before anything is written."""
    changed: dict[str, Any] = {}
    for name, kind, old, _required in fields:
        key = f"field:{name}"
        if kind == "boolean":
            if f"present:{name}" not in form:
                continue
            value: Any = key in form
        else:
            if key not in form:
                continue
            raw = str(checked(name, str(form[key])))
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
                checked(name, value)
        if value != old and not (value in (None, "") and old is None):
            changed[name] = value
    return changed



# The window of the overview's cost per workflow and tenant: the jobs that ended in a day.
JOB_COSTS_WINDOW_SECONDS = 86_400.0


def job_costs_view(costs: Sequence[JobCosts]) -> list[list[str]]:
    """The overview's cost per job and per accepted job, and the prompt cache's share of the
    input and what it saved, a row per workflow and tenant."""
    def usd(value: float | None) -> str:
        return "-" if value is None else f"{value:.6f}"

    return [[c.workflow, c.tenant, str(c.jobs), usd(c.cost_per_job), str(c.accepted),
             usd(c.cost_per_accepted_job),
             "-" if c.cached_share is None else f"{c.cached_share:.1%}",
             usd(c.cache_saved_usd)] for c in costs]
