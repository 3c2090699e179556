"""Admission: which polled requests may be claimed now, and which must wait.

One stage, made of gates (compare dramatiq's middleware): each gate looks at the requests
the gates before it let through and says which of them wait. A request that waits is not
claimed: its job keeps its status (``queued`` for new work, no attempt counted) with a
``waiting_reason`` the gate wrote in the same statement, its message is acknowledged (a
message left pending for as long as a cap holds would block its partition's commits), and
the gate's release pass re-publishes the job when it may run (calmq/processors/reaper.py).

The gates a worker runs, in order:

- ``SpendCapGate``: tenants (or the fleet) past a daily or monthly spend cap
  (calmq.spending); bulk work waits first.
- ``QuotaGate``: a tenant's jobs past what its token quota serves soon (the worker's share
  of it: calmq.calls.quota.TenantQuota.allowance); its interactive jobs count against a
  room of their own, so the tenant's bulk never crowds them out, and a flood of them still
  waits.
- ``FairShareGate`` (setting ``fair_share``): while a queue (pool and priority) is contended,
  new jobs join its waiting room (calmq.data.fairness) instead of taking slots in the order
  Kafka delivered them; the pipeline fills free slots from the room, fairest tenant first.
  It comes before the two gates below, which count the jobs they admit until their claim:
  a job they let through that then waited in the room counted nowhere meanwhile. A job
  picked from the room passes them on its way to the claim.
- ``ReviewCapGate``: jobs that could end in review while their pool's pending reviews are at
  the reviewers' cap (calmq.data.review_caps).
- ``ConcurrencyKeyGate``: jobs whose concurrency key (a customer inside the tenant) has its
  workflow's ``concurrency_limit`` in flight already, fleet-wide (calmq.data.concurrency).

A gate may also keep something until the claim ended (``stack``): fair share counts the
jobs it let through per queue until their attempts start. (The review cap and the
concurrency keys record what they let through on the job row instead, so that another
worker's admission and their release passes count it before its claim.) A new gate (a
provider's credentials refused, a concurrency key, a model's cooldown, a queue's spend cap)
is a ``Gate`` subclass added to the list the process composes; nothing else in the worker
changes.

This module imports no Kafka client: a request's message is opaque here.
"""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Protocol, TypeVar

from calmq.data import Store
from calmq.data.concurrency import ConcurrencyKeys
from calmq.data.fairness import FairQueue
from calmq.data.holds import HeldJobs
from calmq.data.review_caps import ReviewCaps
from calmq.data.spending import SpendLedger
from calmq.holds import gate_statements
from calmq.jobs import Priority
from calmq.processors import metrics
from calmq.processors.request import Request
from calmq.retrying import retry_forever
from calmq.spending import SpendCaps
from calmq.workflows import Workflow

__all__ = ["Admission", "ConcurrencyKeyGate", "FairShareGate", "Gate", "Occupancy",
           "QuotaGate", "ReviewCapGate", "SpendCapGate", "StatementGate", "concurrency_limits",
           "review_workflows", "statement_gates"]

T = TypeVar("T")


class Occupancy(Protocol):
    """What a gate may know of the attempts this process runs now."""

    def running(self, job_id: uuid.UUID) -> bool: ...

    def held_by(self, tenant_id: uuid.UUID, priority: str | None = None) -> int: ...


class Gate:
    """One admission rule."""

    name = "gate"

    async def hold(self, requests: Sequence[Request], occupancy: Occupancy,
                   stack: contextlib.AsyncExitStack) -> set[uuid.UUID]:
        """The ids of the ``requests`` whose jobs must wait: the gate has recorded why on
        each job row (their messages are then acknowledged). A gate whose decision must hold
        until the claim ended enters its lock on ``stack``."""
        raise NotImplementedError


class Admission:
    """Runs the gates in order, acknowledges what they hold, and claims the rest (``then``)
    while every turn a gate took is still held."""

    def __init__(self, gates: Sequence[Gate], acknowledge: Callable[[Request], None]) -> None:
        self.gates = list(gates)
        self.acknowledge = acknowledge

    async def admit(self, requests: list[Request], occupancy: Occupancy,
                    then: Callable[[list[Request]], Awaitable[T]]) -> T:
        async with contextlib.AsyncExitStack() as stack:
            for gate in self.gates:
                if not requests:
                    break
                held = await gate.hold(requests, occupancy, stack)
                if held:
                    rest = []
                    for r in requests:
                        if r.job_id in held:
                            self.acknowledge(r)
                        else:
                            rest.append(r)
                    requests = rest
            return await then(requests)


class SpendCapGate(Gate):
    """Jobs of tenants past a spend cap wait (``spend_cap_daily`` / ``_monthly``)."""

    name = "spend_cap"

    def __init__(self, caps: SpendCaps, ledger: SpendLedger) -> None:
        self.caps = caps
        self.ledger = ledger

    async def hold(self, requests: Sequence[Request], occupancy: Occupancy,
                   stack: contextlib.AsyncExitStack) -> set[uuid.UUID]:
        holds = await self.caps.holds()
        by_reason: dict[str, list[Request]] = {}
        for r in requests:
            tenant = r.tenant_id
            if tenant is None or occupancy.running(r.job_id):
                continue
            reason = holds.reason(tenant, r.priority)
            if reason is not None:
                by_reason.setdefault(reason, []).append(r)
        return await _hold(self.ledger, by_reason)


class StatementGate(Gate):
    """A hold whose rule is its statement alone (``calmq.holds.Hold.gate``): the statement
    takes the jobs about to be claimed and holds those that must wait."""

    def __init__(self, reason: str, statement: str, held: HeldJobs) -> None:
        self.name = reason
        self.statement = statement
        self.held = held

    async def hold(self, requests: Sequence[Request], occupancy: Occupancy,
                   stack: contextlib.AsyncExitStack) -> set[uuid.UUID]:
        ids = [r.job_id for r in requests if not occupancy.running(r.job_id)]
        if not ids:
            return set()
        return await retry_forever(f"holding jobs for {self.name} failed",
                                   lambda: self.held.hold(self.statement, ids))


def statement_gates(store: Store) -> list[Gate]:
    """A gate for each hold whose statement is its own gate (calmq.holds), in the
    registry's order."""
    held = HeldJobs(store)
    return [StatementGate(reason, statement, held)
            for reason, statement in gate_statements().items()]


class QuotaGate(Gate):
    """A tenant's jobs past what its token quota serves soon wait (``token_quota``): this
    worker holds at most ``allowance(tenant, priority)`` of them at once. The tenant's
    interactive jobs count only against each other (its bulk cannot crowd them out), its
    bulk jobs against all it holds; an interactive flood waits all the same, and its calls wait at
    the tenant's quota past their debt bound (calmq.calls.quota.TenantQuota.acquire)."""

    name = "token_quota"

    def __init__(self, allowance: Callable[[uuid.UUID, str], int | None],
                 ledger: SpendLedger) -> None:
        self.allowance = allowance
        self.ledger = ledger

    async def hold(self, requests: Sequence[Request], occupancy: Occupancy,
                   stack: contextlib.AsyncExitStack) -> set[uuid.UUID]:
        # What each tenant holds with this batch's jobs: all of them, the interactive ones.
        taking: dict[uuid.UUID, int] = {}
        taking_interactive: dict[uuid.UUID, int] = {}
        waiting: list[Request] = []
        for r in requests:
            tenant = r.tenant_id
            if tenant is None or occupancy.running(r.job_id):
                continue
            interactive = r.priority == Priority.INTERACTIVE
            allowed = self.allowance(tenant, Priority.INTERACTIVE if interactive else Priority.BULK)
            if allowed is None:
                continue
            held = taking.setdefault(tenant, occupancy.held_by(tenant))
            if interactive:
                mine = taking_interactive.setdefault(
                    tenant, occupancy.held_by(tenant, Priority.INTERACTIVE))
                if mine >= allowed:
                    waiting.append(r)
                    continue
                taking_interactive[tenant] = mine + 1
            elif held >= allowed:
                waiting.append(r)
                continue
            taking[tenant] = held + 1
        return await _hold(self.ledger, {self.name: waiting} if waiting else {})


async def _hold(ledger: SpendLedger, by_reason: dict[str, list[Request]]) -> set[uuid.UUID]:
    held: set[uuid.UUID] = set()
    for reason, requests in by_reason.items():
        ids = [r.job_id for r in requests]

        def hold(ids: list[uuid.UUID] = ids, reason: str = reason
                 ) -> Awaitable[list[uuid.UUID]]:
            return ledger.hold(ids, reason, {})

        held.update(await retry_forever("holding waiting jobs failed", hold))
        for r in requests:
            if r.job_id in held:
                metrics.HELD.labels(r.priority or Priority.BULK).inc()
    return held


def review_workflows(workflows: Mapping[str, Workflow]) -> list[str]:
    """The workflows whose jobs can end in review (the review cap counts those)."""
    return sorted(name for name, w in workflows.items() if w.review_threshold is not None)


class ReviewCapGate(Gate):
    """Jobs that could end in review wait while their pool is at its review cap; the pools
    with a cap are read at most every ``CAPS_TTL`` seconds, not once per batch."""

    name = "review_cap"
    CAPS_TTL = 1.0

    def __init__(self, store: Store, review_workflows: Sequence[str]) -> None:
        self.caps = ReviewCaps(store)
        self.workflows = sorted(review_workflows)
        self._capped: dict[str, int] = {}
        self._read = -float("inf")

    async def hold(self, requests: Sequence[Request], occupancy: Occupancy,
                   stack: contextlib.AsyncExitStack) -> set[uuid.UUID]:
        gated = [r.job_id for r in requests if r.workflow in self.workflows]
        if not gated or not await self._any_cap():
            return set()
        held = await retry_forever(
            "holding jobs for their pool's review cap failed",
            lambda: self.caps.hold(gated, self.workflows))
        if held:
            metrics.REVIEW_CAP_HELD.inc(len(held))
        return held

    async def _any_cap(self) -> bool:
        now = time.monotonic()
        if now - self._read >= self.CAPS_TTL:
            capped = await retry_forever("reading the review caps failed",
                                         self.caps.capped_pools)
            for pool in set(self._capped) - set(capped):
                metrics.REVIEW_CAP.remove(pool)
            for pool, cap in capped.items():
                metrics.REVIEW_CAP.labels(pool).set(cap)
            self._capped = capped
            self._read = now
        return bool(self._capped)


def concurrency_limits(workflows: Mapping[str, Workflow]) -> dict[str, int]:
    """The workflows whose jobs' concurrency keys limit them, with the limit."""
    return {name: w.concurrency_limit for name, w in workflows.items()
            if w.concurrency_limit is not None}


class ConcurrencyKeyGate(Gate):
    """At most a workflow's ``concurrency_limit`` of one key's jobs in flight, fleet-wide.

    In one transaction the batch's keys are locked (advisory locks, one order) and the jobs
    that fit under their keys' limits are admitted (``key_admitted_at``: they count until
    their claim, a running job counts by its status); the rest wait in ``queued``
    (``waiting``, reason ``concurrency_key``, no attempt counted) and the release pass
    (processors/reaper.py) re-publishes them as their key's jobs end. Past ``waiting_max``
    keys waiting for one tenant, a job that must wait waits behind its tenant's keys
    instead (reason ``concurrency_keys_waiting``) until one stops waiting and it takes its
    place. A job admitted and never claimed (its worker died between) gives its place back
    after a lease."""

    name = "concurrency_key"

    def __init__(self, keys: ConcurrencyKeys, limits: Mapping[str, int],
                 admitted_seconds: float, *, waiting_max: int) -> None:
        self.keys = keys
        self.limits = dict(limits)
        self.admitted_seconds = admitted_seconds
        # Distinct keys a tenant's jobs may wait for; past them a job waits behind its
        # tenant's keys (concurrency_keys_waiting_max, calmq/sql/concurrency.sql).
        self.waiting_max = waiting_max

    async def hold(self, requests: Sequence[Request], occupancy: Occupancy,
                   stack: contextlib.AsyncExitStack) -> set[uuid.UUID]:
        ids = [r.job_id for r in requests
               if r.workflow in self.limits and not occupancy.running(r.job_id)]
        if not ids:
            return set()
        held = await retry_forever(
            "admitting jobs by their concurrency keys failed",
            lambda: self.keys.admit(ids, self.limits, self.admitted_seconds,
                                    waiting_max=self.waiting_max))
        if held:
            metrics.CONCURRENCY_KEY_HELD.inc(len(held))
            behind = sum(1 for why in held.values() if why == "concurrency_keys_waiting")
            if behind:
                metrics.CONCURRENCY_KEYS_OVERFLOW.inc(behind)
        return set(held)


class FairShareGate(Gate):
    """Fair share inside each queue of the pool (docs/explanation/fairness.md).

    A queue is contended while its waiting room holds jobs, or while this worker has no free
    slot for it (``room``: the slots of the priority less those in use). Then a new job is
    held in the room (``waiting``, reason ``fair_share``; its message acknowledged, no
    attempt counted) instead of taking the next slot in the order Kafka delivered it, behind
    another tenant's backlog; the pipeline fills each free slot from the room, the tenant
    furthest below its weighted share of the queue's running jobs first (``pick``). An
    uncontended queue costs nothing: its jobs pass straight to the claim.

    Holding what cannot start now also keeps the consumer reading while the slots are full
    (the worker reads ahead past them, processors/consumer.py ``read_ahead``), so a small
    tenant's job that arrives behind a backlog is seen at once, not after it."""

    name = "fair_share"

    def __init__(self, queue: FairQueue, pool: str,
                 room: Callable[[str, Mapping[str, int]], int],
                 priorities: Sequence[str] = tuple(Priority), *,
                 headroom: Callable[[], int] = lambda: 0) -> None:
        self.queue = queue
        self.pool = pool
        # The jobs of a queue this worker may start now, given those on their way to a slot
        # per queue (processors/worker.py ``_room``): counted per queue, so that bulk's picks
        # in progress take no place in the interactive reserve.
        self.room = room
        # Of a queue's room, what a tenant above its weighted share leaves free while another
        # tenant runs or waits in it (processors/worker.py ``_headroom``): that tenant's
        # next job then starts its call at once instead of when a call ends. A backlog's
        # calls, started together, end together, and a job that came just after a wave of
        # ends waited up to ~0.7 s for the next (calmq bench fairness).
        self.headroom = headroom
        self.priorities = list(priorities)
        # Queues whose waiting room this process last saw holding jobs.
        self.contended: set[str] = set()
        # Per queue, the jobs let through or picked whose attempts have not started yet.
        self._passing: dict[str, int] = dict.fromkeys(self.priorities, 0)

    def free(self, priority: str, also: Mapping[str, int] | None = None) -> int:
        """Slots of the queue no attempt and no claim in progress takes (nor ``also``: what
        the caller is letting through per queue)."""
        if not also:
            return self.room(priority, self._passing)
        passing = dict(self._passing)
        for other, n in also.items():
            passing[other] = passing.get(other, 0) + n
        return self.room(priority, passing)

    def taking(self, priority: str, n: int,
               stack: contextlib.AsyncExitStack | None = None) -> None:
        """Count ``n`` jobs of the queue on their way to a slot until ``stack`` closes (or
        ``done``)."""
        self._passing[priority] = self._passing.get(priority, 0) + n
        if stack is not None:
            stack.callback(self.done, priority, n)

    def done(self, priority: str, n: int) -> None:
        self._passing[priority] -= n

    async def hold(self, requests: Sequence[Request], occupancy: Occupancy,
                   stack: contextlib.AsyncExitStack) -> set[uuid.UUID]:
        waiting: list[uuid.UUID] = []
        # Per queue: the queues share the slots (what one lets through the other cannot use),
        # but for the interactive reserve, which is interactive work's alone.
        passed: dict[str, int] = {}
        for r in requests:
            if r.tenant_id is None or r.from_room or occupancy.running(r.job_id):
                continue  # a job the fill took from the room has had its turn
            priority = r.priority
            if priority in self.contended or self.free(priority, passed) <= 0:
                waiting.append(r.job_id)
                continue
            passed[priority] = passed.get(priority, 0) + 1
        for priority, n in passed.items():
            self.taking(priority, n, stack)
        if not waiting:
            return set()
        held = await retry_forever("holding jobs in the waiting room failed",
                                   lambda: self.queue.hold(waiting))
        for r in requests:
            if r.job_id in held:
                self.contended.add(r.priority)
                metrics.FAIR_SHARE_HELD.labels(r.priority).inc()
        return held
