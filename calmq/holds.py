"""Every reason a job waits, declared once: who holds it, the statements that hold and release
it, the pass that runs the release and how often, the metric that counts it, and what the
API and the console say about it.

A held job keeps its status (``queued``, or ``retrying``) with ``jobs.waiting_reason`` set
(the review cap alone has columns of its own, ``review_cap_held_at``), holds no lease, and
its message was acknowledged: only its release writes it a fresh ``job.requested``. So a
reason without a release that knows it strands its jobs until the sweeper's grace, and a
release that takes reasons it does not own lets them past their hold (the spend-cap pass
once released any reason after ten minutes, issue 45). The statements are the names of
calmq/sql/*.sql queries (or a migration's trigger function); the passes (``Pass``: a
housekeeping task's name, the statement it runs and how often) are what the housekeeping
schedules, iterating ``passes()`` (processors/releases.py): a pass without code of its own
there runs its statement alone, re-publishing the jobs it returns.

``tests/unit/test_holds.py`` fails when the SQL or the Python names a ``waiting_reason``
this registry lacks, when a statement or pass it names does not exist, and when
docs/reference/api.md does not name a reason; the console's job page reads its sentence
here (``says``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Literal

__all__ = ["HOLDS", "Hold", "Pace", "Pass", "gate_statements", "notice", "passes"]

Says = Callable[[Mapping[str, Any]], str]

# How often a release pass runs: ``reaper``, the housekeeping's interval (a third of the
# lease); ``sweeper``, a tenth of sweeper_grace_seconds but never more often than the reaper;
# ``spend_refresh``, spend_cap_refresh_seconds; ``second``, every second from the start.
Pace = Literal["reaper", "sweeper", "spend_refresh", "second"]


@dataclass(frozen=True)
class Pass:
    """A housekeeping task that ends holds: its name, the release statement it runs (a
    calmq/sql query returning the jobs it re-publishes) and how often it runs."""

    task: str
    statement: str
    pace: Pace = "reaper"
    # At most this many seconds apart where a workflow uses the hold (a concurrency limit,
    # fallback models, a key rate limit): its next job waits for the pass.
    busy: float | None = None


SPEND_RELEASE: Final = Pass("spend-release", "release_jobs", "spend_refresh")


@dataclass(frozen=True)
class Hold:
    reason: str  # jobs.waiting_reason, and the detail.reason of the job's ``waiting`` event
    set_by: str  # who holds a job for it
    holds: tuple[str, ...]  # the statements that set it
    releases: tuple[str, ...]  # the statements that end it
    released_by: str  # what runs the release, and how often
    metric: str  # what counts the holds and releases (a label: its value)
    api: str  # what docs/reference/api.md says of it
    # The console's sentence, from the detail of the job's newest ``waiting`` event (for
    # ``children``: of its ``children_spawned`` event). None: the page has a notice of its own.
    says: Says | None
    passes: tuple[Pass, ...] = ()  # the housekeeping's passes that release it
    # A hold statement that decides as well as holds (it takes the ids of the jobs a worker
    # is about to claim, holds those that must wait and returns their ids): every worker
    # runs it as an admission gate of its own (processors.admission.StatementGate), so a
    # reason whose rule is SQL alone needs no gate written by hand.
    gate: str = ""
    task: str = ""  # a task outside the housekeeping that releases it (the provider gate's)
    resumed: str = ""  # the detail.reason of the ``resumed`` event its release writes, if any
    column: str = "waiting_reason"  # where the hold is kept on the job row


def _text(sentence: str) -> Says:
    return lambda _detail: sentence


def _spend_cap(window: str, fleet: bool) -> Hold:
    whose = "the whole fleet is" if fleet else "its tenant is"
    setting = (f"CALMQ_SPEND_CAP_FLEET_{window.upper()}_USD" if fleet
               else f"the tenant's spend_cap_{window}_usd")
    return Hold(
        f"{'fleet_' if fleet else ''}spend_cap_{window}",
        set_by="the spend gate (processors.admission.SpendCapGate, calmq.spending), and the "
               "batch lane's packing for a pack past the cap",
        holds=("hold_jobs", "batch_hold_packed"),
        releases=("release_jobs",),
        released_by="the spend release, every spend_cap_refresh_seconds, one pass at a time "
                     "in the fleet: once the window rolled over or the cap was raised",
        metric="calmq_jobs_held_total{priority}, calmq_jobs_released_total",
        api=f"{whose} past its {window} spend cap ({setting})",
        says=_text(f"{whose} past its {window} spend cap; it runs when the UTC "
                   f"{'day' if window == 'daily' else 'month'} rolls over or the cap is "
                   "raised (bulk work waits first, at spend_cap_bulk_fraction of the cap)"),
        passes=(SPEND_RELEASE,), resumed="under_cap")


def _children(d: Mapping[str, Any]) -> str:
    join = d.get("policy", "all")
    if join == "at_least":
        join = f"at least {d.get('k', '')}"
    return (f"a step started {d.get('count', '')} child jobs of {d.get('workflow', '')}; "
            f"step {d.get('next_step', '')} runs when their join ({join}) holds")


def _model_cooldown(d: Mapping[str, Any]) -> str:
    models = ", ".join(str(m) for m in d.get("models") or [])
    return (f"every model its step allows ({models}) is cooling down after a 429; it runs "
            f"again in about {d.get('seconds', '')} s, no attempt counted")


def _rate_limit_key(d: Mapping[str, Any]) -> str:
    limit = d.get("limit") or {}
    per = limit.get("per_seconds", "") if isinstance(limit, dict) else ""
    counts = " and ".join(f"{limit[k]} {k}" for k in ("requests", "tokens")
                          if isinstance(limit, dict) and k in limit)
    return (f"its concurrency key {d.get('key', '')} used its rate limit ({counts} per "
            f"{per} s); it runs again in about {d.get('seconds', '')} s, no attempt counted")


_TIMED = ("an attempt's hand-back (processors.failures.hand_back_waiting: the call was not "
          "made, no attempt counted)")
_TIMED_RELEASE = ("timed-wait release, every 0.5 s where a step has fallback models or a "
               "workflow a key_rate_limit (else at the reaper's pace), in every process: "
               "once waiting_until passed")

_TIMED_PASS = Pass("timed-wait-release", "timed_wait_release_jobs", busy=0.5)
_CONCURRENCY_RELEASE = Pass("concurrency-key-release", "concurrency_release", busy=0.2)

_ALL: Final = (
    _spend_cap("daily", fleet=False),
    _spend_cap("monthly", fleet=False),
    _spend_cap("daily", fleet=True),
    _spend_cap("monthly", fleet=True),
    Hold("token_quota",
         set_by="the quota gate (processors.admission.QuotaGate): past the worker's share of "
                "its tenant's tokens_per_minute",
         holds=("hold_jobs",),
         releases=("release_quota_jobs", "release_jobs"),
         released_by="the quota release every second in each worker, as many as the quota "
                      "serves (interactive first); the spend release once a job waited "
                      "past its stale seconds (no worker runs quotas any more)",
         metric="calmq_jobs_held_total{priority}, calmq_jobs_released_total",
         api="more of its tenant's calls wait for the tenant's token quota than the quota "
             "serves soon",
         says=_text("more of its tenant's calls wait for the tenant's token quota than the "
                    "quota serves soon; it runs as the quota refills"),
         passes=(Pass("quota-release", "release_quota_jobs", "second"), SPEND_RELEASE),
         resumed="quota_refilled"),
    Hold("provider_blocked",
         set_by="an attempt that met a blocked provider (processors.failures."
                "hand_back_blocked), and the batch lane's hand-back (processors.batcher)",
         holds=("provider_hand_back", "batch_hand_back"),
         releases=("provider_release_jobs",),
         released_by="the provider gate once the block lifts (a probe call every "
                      "provider_probe_seconds succeeded, or calmq provider unblock), told "
                      "by LISTEN calmq_providers",
         metric="calmq_provider_handbacks_total{code}, calmq_provider_blocked",
         api="its model provider is blocked fleet-wide: a bad key, a missing permission or "
             "model, exhausted billing, confirmed by a probe call or a second job",
         says=lambda d: (f"its provider {d.get('provider', '')} ({d.get('model', '')}) is "
                         f"blocked fleet-wide ({d.get('code', '')}); it runs again when the "
                         "block lifts, no attempt counted"),
         task="provider-probe-", resumed="provider_unblocked"),
    Hold("fair_share",
         set_by="the fair-share gate (processors.admission.FairShareGate, setting "
                "fair_share): its queue was contended",
         holds=("fair_share_hold", "fair_share_return_picked"),
         releases=("fair_share_pick", "fair_share_release_stale"),
         released_by="a worker's pick as a slot of the queue frees (fairest tenant first); "
                      "the stale pass every tenth of sweeper_grace_seconds for a room no "
                      "worker takes from",
         metric="calmq_fair_share_held_total{priority}, calmq_fair_share_picked_total"
                "{priority}",
         api="its queue is contended and the free slots go to tenants further below their "
             "weighted share",
         says=lambda d: (f"the {d.get('priority', '')} queue of pool {d.get('pool', '')} is "
                         "contended; this job starts when a slot frees and its tenant is "
                         "the furthest below its weighted share"),
         passes=(Pass("fair-share-stale", "fair_share_release_stale", "sweeper"),),
         resumed="fair_share_stale"),
    Hold("fair_share_picked",
         set_by="a worker's pick out of a waiting room (fair_share_pick), on its way to "
                "the claim",
         holds=("fair_share_pick",),
         releases=("claim_jobs", "hold_for_review_cap", "fair_share_return_picked"),
         released_by="the claim, milliseconds later; the reaper's pass puts a job not "
                      "claimed within a lease back into the room",
         metric="calmq_fair_share_picked_total{priority}",
         api="a worker took it out of the waiting room for a free slot and is claiming it",
         says=_text("a worker took it out of its queue's waiting room for a free slot and is "
                    "claiming it"),
         passes=(Pass("fair-share-picked", "fair_share_return_picked"),)),
    Hold("concurrency_key",
         set_by="the concurrency-key gate (processors.admission.ConcurrencyKeyGate): its "
                "key has its workflow's concurrency_limit in flight",
         holds=("concurrency_admit", "concurrency_promote_overflow"),
         releases=("concurrency_release",),
         released_by="the concurrency-key release, every 0.2 s where a workflow has a "
                      "limit (else at the reaper's pace), one pass at a time in the fleet",
         metric="calmq_concurrency_key_held_total, calmq_concurrency_key_resumed_total",
         api="its concurrency_key has its workflow's concurrency_limit in flight",
         says=lambda d: (f"its concurrency key {d.get('key', '')} has {d.get('limit', '')} "
                         "jobs in flight, its workflow's limit; it starts as they end"),
         passes=(_CONCURRENCY_RELEASE,), resumed="concurrency_key"),
    Hold("concurrency_keys_waiting",
         set_by="the concurrency-key gate, past concurrency_keys_waiting_max keys waiting "
                "for the job's tenant",
         holds=("concurrency_admit",),
         releases=("concurrency_promote_overflow",),
         released_by="the concurrency-key release: as the tenant's keys stop waiting, the "
                      "job waits for its own key (concurrency_key)",
         metric="calmq_concurrency_keys_waiting_total",
         api="its tenant's jobs wait for concurrency_keys_waiting_max concurrency keys "
             "already; it waits for its own key once one of those stops waiting",
         says=lambda d: (f"its tenant's jobs wait for {d.get('max_waiting_keys', '')} "
                         "concurrency keys already; it waits for its own key "
                         f"{d.get('key', '')} once one of them stops waiting"),
         passes=(_CONCURRENCY_RELEASE,)),
    Hold("model_cooldown",
         set_by=f"calmq.calls.fallback (ModelsCooling): {_TIMED}",
         holds=("provider_hand_back",),
         releases=("timed_wait_release_jobs",),
         released_by=_TIMED_RELEASE,
         metric="calmq_waited_uncounted_total{reason}, calmq_wait_resumed_total{reason}",
         api="every model its step allows is cooling down after a 429",
         says=_model_cooldown, passes=(_TIMED_PASS,), resumed="model_cooldown"),
    Hold("rate_limit_key",
         set_by=f"calmq.calls.key_rates (KeyRateLimited): {_TIMED}",
         holds=("provider_hand_back",),
         releases=("timed_wait_release_jobs",),
         released_by=_TIMED_RELEASE,
         metric="calmq_waited_uncounted_total{reason}, calmq_wait_resumed_total{reason}",
         api="its concurrency_key used its workflow's key_rate_limit",
         says=_rate_limit_key, passes=(_TIMED_PASS,), resumed="rate_limit_key"),
    Hold("children",
         set_by="a step that started child jobs (calmq.workflows.progress, written by "
                "finish_attempts), or a redrive re-arming its failed join",
         holds=("finish_attempts", "children_rearm"),
         releases=("calmq_settle_child",),
         released_by="the trigger calmq_settle_child (migration 0053), in the transaction "
                      "that settles the child whose end decides the join",
         metric="",
         api="a step of the job started child jobs and the job waits, holding no worker, "
             "until their join holds",
         says=_children),
    Hold("parent_in_flight",
         set_by="a spawning step's children past CALMQ_CHILDREN_IN_FLIGHT_MAX "
                "(insert_children), and a redrive's failed children past the room left "
                "(children_requeue_failed): their job.requested waits in "
                "job_held_children",
         holds=("insert_children", "children_requeue_failed"),
         releases=("calmq_settle_child",),
         released_by="the trigger calmq_settle_child: each child that ends releases the "
                      "next, in input order",
         metric="",
         api="a child job past its parent's CALMQ_CHILDREN_IN_FLIGHT_MAX",
         says=_text("its parent has as many children in flight as it may; it starts as an "
                    "earlier sibling ends")),
    Hold("review_cap",
         set_by="the review-cap gate (processors.admission.ReviewCapGate): its pool's "
                "pending reviews are at the pool's cap",
         holds=("hold_for_review_cap",),
         releases=("release_review_cap_holds",),
         released_by="the review-cap release, at the reaper's pace, as decided reviews make "
                      "room",
         metric="calmq_review_cap_held_total, calmq_review_cap_resumed_total",
         api="its pool's pending reviews are at the pool's review cap (the job's "
             "waiting_reason stays null: the history's waiting event names it)",
         says=None,  # the job page's own notice (job.html), which names the pool
         passes=(Pass("review-cap-release", "release_review_cap_holds"),),
         resumed="review_cap", column="review_cap_held_at"),
)

HOLDS: Final[dict[str, Hold]] = {h.reason: h for h in _ALL}
assert len(HOLDS) == len(_ALL), "a waiting reason is declared twice"


def passes() -> dict[str, tuple[Pass, tuple[str, ...]]]:
    """The housekeeping's release passes by task name, each with the reasons it releases, in
    the registry's order."""
    found: dict[str, tuple[Pass, tuple[str, ...]]] = {}
    for hold in _ALL:
        for p in hold.passes:
            known, reasons = found.get(p.task, (p, ()))
            assert known == p, f"the pass {p.task} is declared two ways"
            found[p.task] = (p, (*reasons, hold.reason))
    return found


def gate_statements() -> dict[str, str]:
    """The holds whose statement is their own admission gate: reason -> statement."""
    return {h.reason: h.gate for h in _ALL if h.gate}


def notice(reason: str, detail: Mapping[str, Any]) -> str | None:
    """What the console says of a job waiting for ``reason`` (its event's ``detail``);
    None when the page has a notice of its own. A reason not registered (a newer worker's)
    points at the history."""
    hold = HOLDS.get(reason)
    if hold is None:
        return "see its history below"
    return None if hold.says is None else hold.says(detail)
