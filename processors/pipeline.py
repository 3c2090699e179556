"""The stages of a worker, composed: intake -> admission -> claim -> attempt -> commit, with
the leases of what runs.

For polled messages (``submit``, called on the event loop by the consumer thread): intake
decodes them (poison to calmq.dlq), admission holds what must wait, the claim takes every
other job in one statement (what arrives during a claim joins the next one), each claimed
job's attempt runs in its own task under its lease, and its outcome goes to the group
commit, which marks the offset done once the outcome is durable. A message whose job is
terminal, cancelled or held by a live lease is acknowledged without a model call.

``calmq worker`` and ``calmq batcher`` both run one (processors/worker.py,
processors/batcher.py); they differ in the attempt's provider (the metered gateway, or the
batch packer) and in their admission gates.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime

from confluent_kafka import Message

from calmq import logs, topics, tracing
from calmq.calls.caching import CacheUse
from calmq.calls.wires import ModelClock, model_clock
from calmq.data import Finish, Job, Store
from calmq.errors import FailureClass, LeaseLost, StepFailure
from calmq.failure_codes import ProviderBlocked, WaitUncounted
from calmq.jobs import Priority, Status
from calmq.processors import metrics
from calmq.processors.admission import Admission, FairShareGate, Gate
from calmq.processors.attempt import Attempt
from calmq.processors.claim import Claim
from calmq.processors.commit import Committer
from calmq.processors.deadlines import note_deadline_and_tiers
from calmq.processors.failures import FailureStage, hand_back_blocked, hand_back_waiting
from calmq.processors.intake import Intake
from calmq.processors.leases import Leases
from calmq.processors.offsets import OffsetTracker
from calmq.processors.request import Request
from calmq.retrying import Backoff, retry_forever
from calmq.settings import Settings
from calmq.workflows import Workflow

__all__ = ["Pipeline", "UsageSink", "failure_stage"]

log = logging.getLogger(__name__)

# Writes an attempt's model usage on its own: (job_id, input, output tokens, cost, calls,
# cache=CacheUse): UsageRecorder.record.
UsageSink = Callable[..., Awaitable[None]]


def failure_stage(settings: Settings, worker_id: str,
                  workflows: Mapping[str, Workflow]) -> FailureStage:
    """The failure stage a process's attempts use, from its settings."""
    s = settings
    return FailureStage(worker_id=worker_id, tiers=s.retry_tier_list,
                        backoff=Backoff(s.retry_initial_seconds, s.retry_max_seconds,
                                        s.retry_multiplier),
                        workflows=workflows, max_attempts=s.max_attempts)


class Pipeline:
    # Claims in flight at once. Messages that arrive while they run join the next claim: one
    # statement per message when the worker is quiet (no waiting to fill a batch), hundreds
    # per statement when it is busy (the group commit does for outcomes).
    CLAIMERS = 2
    CLAIM_BATCH = 500
    # A claim batch's attempts are started this many at a time, with a turn of the event
    # loop between: 500 attempts started in one step run their first steps (a request, at
    # startup a new connection each) in one iteration, which held timers and heartbeats
    # back ~100 ms while a worker filled 5,000 slots (bench longcalls).
    STEP_WORK = 64

    def __init__(self, *, store: Store, tracker: OffsetTracker, intake: Intake,
                 gates: Sequence[Gate], attempt: Attempt, worker_id: str,
                 lease_seconds: float, workflows: Mapping[str, Workflow],
                 usage: UsageSink | None = None,
                 fair: FairShareGate | None = None) -> None:
        self.store = store
        self.fair = fair  # the waiting room's gate (setting fair_share), when on
        self.worker_id = worker_id
        self.tracker = tracker
        self.intake = intake
        self.attempt = attempt
        self.usage = usage
        self.leases = Leases(store, worker_id=worker_id, lease_seconds=lease_seconds)
        self.admission = Admission(gates, self._held)
        self.claim = Claim(store, worker_id=worker_id, lease_seconds=lease_seconds,
                           workflows=workflows, acknowledge=self._done,
                           resubmit=lambda msg: self.submit([msg]))
        self.committer = Committer(store, tracker)
        self._inbox: list[Message] = []
        self._claimers: set[asyncio.Task[None]] = set()
        self._claiming = 0  # claimers still looping (their tasks may not have ended yet)
        self._handbacks: set[asyncio.Task[None]] = set()
        self._abandoning = False
        self._draining = False  # no job is taken from a waiting room once set
        self._picked: set[uuid.UUID] = set()  # running jobs taken from a waiting room
        self._filling: asyncio.Task[None] | None = None
        self._fill_again = False

    def start(self) -> None:
        self.committer.start()

    # -- what the process reads ------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        return len(self.leases)

    @property
    def claiming(self) -> bool:
        """Polled messages are still being decoded or claimed."""
        return self._claiming > 0

    def idle(self) -> bool:
        return not len(self.leases) and not self._claiming and self.committer.pending == 0

    def job(self, job_id: uuid.UUID) -> Job | None:
        """The job of a running attempt (None: not running here)."""
        return self.leases.job(job_id)

    def stop(self, job_id: uuid.UUID) -> bool:
        """End a running attempt with no outcome; its message is acknowledged."""
        return self.leases.stop(job_id)

    # -- intake to attempts ----------------------------------------------------------------

    def submit(self, batch: list[Message]) -> None:
        """Called on the loop (call_soon_threadsafe) with polled messages."""
        self._inbox.extend(batch)
        if self._claiming < self.CLAIMERS:
            self._claiming += 1
            task = asyncio.create_task(self._claim_inbox())
            self._claimers.add(task)
            task.add_done_callback(self._claimers.discard)

    async def _claim_inbox(self) -> None:
        try:
            while self._inbox:
                batch = self._inbox[: self.CLAIM_BATCH]
                del self._inbox[: len(batch)]
                requests = await self.intake.read(batch)
                if requests:
                    await self.admission.admit(requests, self.leases, self._claim_and_start)
        finally:
            # Counted down in the same step as the empty-inbox check: a submit after it
            # starts a new claimer, so no message is left in the inbox without one.
            self._claiming -= 1

    async def _claim_and_start(self, requests: list[Request]) -> None:
        if self.fair is not None and self.fair.contended:
            self.fill_soon()  # what admission just held may have a free slot already
        if not requests:
            return
        claimed = await self.claim.claim(requests, self.leases.running)
        await self._start(claimed.jobs, claimed.at)

    async def _start(self, jobs: Sequence[tuple[Request, Job]], at: float) -> None:
        for begun, (request, job) in enumerate(jobs, 1):
            task = asyncio.create_task(self._run(job, request))
            self.leases.hold(job, task, at)
            if begun % self.STEP_WORK == 0:
                await asyncio.sleep(0)  # let these attempts take their first step

    # -- the waiting room (setting fair_share) ---------------------------------------------

    def fill_soon(self) -> None:
        """Fill this process's free slots from the waiting rooms of its lanes: after a hold,
        when an attempt ends, and on the worker's tick (another worker's holds)."""
        if self.fair is None or self._draining:
            return
        if self._filling is not None and not self._filling.done():
            self._fill_again = True  # one fill at a time; it goes round once more
            return
        self._filling = asyncio.create_task(self._fill(self.fair))

    async def _fill(self, fair: FairShareGate) -> None:
        try:
            while True:
                self._fill_again = False
                for priority in fair.priorities:
                    n = min(fair.free(priority), self.CLAIM_BATCH)
                    if n <= 0 or self._draining:
                        continue
                    if priority == Priority.INTERACTIVE and priority not in fair.contended:
                        # Look before reserving: a pick reserves the queue's free slots
                        # while it runs, and a pick of an empty interactive room on every
                        # tick held the interactive jobs arriving then (bench priority).
                        # Bulk picks without the look: its arrivals held during a pick
                        # are picked next, and under the look a loaded two-worker fleet
                        # held 12 bulk attempts where the window is 10 (cause not found).
                        if not await self._room_waits(fair, priority):
                            continue  # nothing to pick: the slots stay open to arrivals
                        # what arrived during the look may have taken some of the slots
                        n = min(fair.free(priority), self.CLAIM_BATCH)
                        if n <= 0:
                            continue
                    fair.taking(priority, n)  # the gate lets no new job in them meanwhile
                    try:
                        await self._take_from_room(fair, priority, n)
                    finally:
                        fair.done(priority, n)
                if not self._fill_again:
                    return
        except Exception:  # the database calls retry; anything else is a bug, logged here
            # (the next attempt's end or tick fills again; what was picked and not claimed
            # goes back into the room after a lease: the reaper's fair_share_return_picked)
            log.exception("filling free slots from the waiting room failed")

    @staticmethod
    async def _room_waits(fair: FairShareGate, priority: str) -> bool:
        """A queue this worker holds no job of: whether another worker's holds wait in its
        room (then the queue is contended here too, until a pick empties it)."""
        waits = await retry_forever("looking into the waiting room failed",
                                    lambda: fair.queue.waiting(fair.pool, priority))
        if waits:
            fair.contended.add(priority)
        return waits

    async def _take_from_room(self, fair: FairShareGate, priority: str, n: int) -> None:
        pick = await retry_forever(
            "picking jobs from the waiting room failed",
            lambda: fair.queue.pick(fair.pool, priority, n, fair.headroom()))
        if not pick.more:
            fair.contended.discard(priority)  # the room is empty (this worker took the rest)
        picked = pick.jobs
        if not picked:
            return
        metrics.FAIR_SHARE_PICKED.labels(priority).inc(len(picked))
        # No message carries a picked job: its position names no partition of this
        # consumer, so marking it done commits nothing (processors/offsets.py). It goes
        # through admission's other gates (a spend cap, a concurrency key may hold it now).
        where = ((topics.topic_for_route(topics.work_route(fair.pool, priority)), -1), -1)
        requests = [Request(position=where, job_id=p.id, step=p.step, workflow=p.workflow,
                            tenant=str(p.tenant_id), priority=priority, message=None)
                    for p in picked]
        await self.admission.admit(requests, self.leases, self._claim_picked)

    async def _claim_picked(self, requests: list[Request]) -> None:
        if not requests:
            return
        at = time.monotonic()  # the leases the claim grants start after this
        steps = {r.job_id: r.step for r in requests}
        # A picked job is queued with no message (reason fair_share_picked): claimed here,
        # or (cancelled meanwhile, the database gone after the pick, this worker killed)
        # back into its room after a lease (the reaper's fair_share_return_picked).
        jobs = await retry_forever("claiming jobs from the waiting room failed",
                                   lambda: self.store.jobs.claim(
                                       list(steps), self.worker_id,
                                       self.leases.lease_seconds, steps))
        self._picked.update(job.id for job in jobs)
        # Started in the pick's order, fairest first (the claim returns them by id, and the
        # backlog's older ids would put a newcomer's attempt at the end of the wave).
        claimed = {job.id: job for job in jobs}
        await self._start([(r, claimed[r.job_id]) for r in requests if r.job_id in claimed],
                          at)

    def _done(self, position: tuple[tuple[str, int], int]) -> None:
        self.tracker.done(*position)

    def _held(self, request: Request) -> None:
        """Admission held the request's job (it waits in the database): acknowledged."""
        self.claim.forget(request.position)
        self.tracker.done(*request.position)

    # -- one attempt -----------------------------------------------------------------------

    async def _run(self, job: Job, request: Request) -> None:
        position = request.position
        topic = request.topic
        # This task's context: every record logged while the attempt runs (runner, gateway,
        # budget) names the job, attempt and trace; the model clock times its model calls.
        logs.bind(job_id=str(job.id), attempt=job.attempt, step=job.step,
                  trace_id=logs.trace_id(job.trace_parent))
        # The attempt's model calls are timed and metered here; their tokens and cost go into
        # the outcome's transaction (one write per attempt, not one more per call).
        clock = model_clock()
        started = time.monotonic()
        try:
            attributes: dict[str, str | int] = {
                "calmq.job_id": str(job.id), "calmq.attempt": job.attempt,
                "calmq.step": job.step}
            with tracing.span("calmq.attempt", job.trace_parent, **attributes):
                finish = await self.attempt.run(job, topic)
        except WaitUncounted as waiting:
            # No call was made: every model the step allows cools down after a 429
            # (calmq.fallback), or the job's key is at its rate limit (calmq.rate_keys). The
            # job waits queued for that long, no attempt counted.
            await retry_forever("handing back a job that waits for room failed",
                                functools.partial(hand_back_waiting, self.store, job,
                                                  self.worker_id, waiting))
            self.tracker.done(*position)
            await self._record_usage(job, clock)  # an earlier call of the step was spent
            return
        except ProviderBlocked as blocked:
            # The provider and model are blocked fleet-wide (bad key, permission, model,
            # billing): the job waits queued, no attempt counted (processors/failures.py).
            await self._hand_back_blocked(job, position, blocked)
            return
        except LeaseLost as exc:
            # The database refused a write of this attempt (a side-effect record): another
            # attempt holds the job now, with its own message. No outcome; acknowledge.
            log.warning("attempt %d of %s stopped: %s", job.attempt, job.id, exc.message)
            metrics.FENCED.labels("stale_write").inc()
            self.tracker.done(*position)
            await self._record_usage(job, clock)
            return
        except Exception:
            # Building the outcome failed (the failure stage itself raised): the attempt
            # still ends, once, as a bug, so its offset and lease are released.
            log.exception("the outcome of attempt %d of %s could not be built", job.attempt,
                          job.id)
            finish = self.attempt.failures.outcome(job, topic, StepFailure(
                "the attempt's outcome could not be recorded", code="unhandled_exception",
                failure_class=FailureClass.BUG))
        except asyncio.CancelledError:
            if self._abandoning:
                # Abandoned at shutdown: leave the offset pending so the partition's next
                # owner reads the message again.
                pass
            elif self.leases.fenced(job.id):
                # Stopped by this process before its lease could run out (heartbeats
                # failing): no outcome, and the offset stays pending; the message is claimed
                # again once the database answers (the claim then decides who runs it).
                self._hand_back(job, request.message)
            else:
                # The lease was lost (cancelled job, or a reaper requeued it), or the batch
                # lane recorded the job in a batch: discard the result and acknowledge.
                self.tracker.done(*position)
            # No outcome will carry them: the tokens the provider counted are still spent.
            await self._record_usage(job, clock)
            if clock.cost_usd:
                metrics.JOB_COST.labels(job.workflow, str(job.tenant_id), "abandoned").inc(
                    clock.cost_usd)
            return
        finally:
            self.leases.end(job.id)
            self._picked.discard(job.id)
            if self.fair is not None and self.fair.contended:
                self.fill_soon()  # a slot freed: the fairest waiting job takes it
        finish.usage = {"model_calls": clock.calls, "input_tokens": clock.input_tokens,
                        "output_tokens": clock.output_tokens, "cost_usd": clock.cost_usd,
                        "model": clock.model,
                        "cached_input_tokens": clock.cached_input_tokens,
                        "cache_write_tokens": clock.cache_write_tokens,
                        "cache_saved_usd": clock.cache_saved_usd}
        note_deadline_and_tiers(job, finish, clock)  # the history's tiers and lateness
        _observe(job, finish, time.monotonic() - started, clock.seconds)
        _cost(job, finish, clock.cost_usd)
        self.committer.add(finish, position)

    async def _hand_back_blocked(self, job: Job, position: tuple[tuple[str, int], int],
                                 blocked: ProviderBlocked) -> None:
        """The offset is done once the job row says it waits: the block's release writes a
        fresh job.requested for it."""
        await retry_forever("handing back a job whose provider is blocked failed",
                            lambda: hand_back_blocked(self.store, job, self.worker_id,
                                                      blocked))
        self.tracker.done(*position)

    async def _record_usage(self, job: Job, clock: ModelClock) -> None:
        if not clock.calls or self.usage is None:
            return
        try:
            await self.usage(str(job.id), clock.input_tokens, clock.output_tokens,
                             clock.cost_usd, clock.calls, cache=CacheUse(
                                 clock.cached_input_tokens, clock.cache_write_tokens,
                                 read_saved_usd=clock.cache_saved_usd))
        except Exception:  # metering must not keep a stopped attempt from ending
            log.exception("recording the usage of an abandoned attempt of %s failed", job.id)

    def _hand_back(self, job: Job, msg: Message | None) -> None:
        """Claim a self-fenced attempt's message again, once its lease is handed back (a job
        picked from the waiting room has none: it goes back into the room)."""
        fair = self.fair

        async def hand_back() -> None:
            await self.leases.hand_back(job)
            if msg is not None:
                self.submit([msg])
            elif fair is not None:
                await retry_forever("returning a job to the waiting room failed",
                                    lambda: fair.queue.hold([job.id]))
                fair.contended.add(job.priority)

        task = asyncio.create_task(hand_back())
        self._handbacks.add(task)
        task.add_done_callback(self._handbacks.discard)

    # -- shutdown --------------------------------------------------------------------------

    async def drain(self, grace_seconds: float) -> None:
        """Stop the way every process of the processors stops, once its consumer paused:
        in-flight work gets the grace period to finish; what is left is abandoned with its
        lease handed back (its offset stays uncommitted, so the next owner redoes it), also
        what a claim still in progress hands over; then the last outcomes are written."""
        loop = asyncio.get_running_loop()
        self._draining = True
        log.info("stopping: %d in flight, grace %.1f s", self.in_flight, grace_seconds)
        deadline = loop.time() + grace_seconds
        while not self.idle() and loop.time() < deadline:  # noqa: ASYNC110 - once, at exit
            await asyncio.sleep(0.05)
        abandoned = await self._abandon()
        if abandoned:
            log.warning("abandoned %d attempts at the end of the grace period", abandoned)
        while self.claiming or (self._filling is not None  # noqa: ASYNC110 - at exit
                                and not self._filling.done()):
            await asyncio.sleep(0.01)  # a batch still claiming hands over its jobs
        await self._abandon()
        await self.committer.drain()

    async def _abandon(self) -> int:
        self._abandoning = True
        picked = set(self._picked)  # their attempts end (and leave the set) in release_all
        released = await self.leases.release_all()
        fair = self.fair
        if picked and fair is not None:
            # No message carries them to the partition's next owner: back into the waiting
            # room, for the fleet's other workers to pick (the sweeper's, were this to fail).
            try:
                await fair.queue.hold(list(picked))
            except Exception:
                log.exception("returning %d jobs to the waiting room failed", len(picked))
        return released


def _cost(job: Job, finish: Finish, cost: float) -> None:
    """The attempt's cost, apart by kind: what retries and dead letters cost shows."""
    tenant = str(job.tenant_id)
    if finish.status == Status.DEAD_LETTER:
        kind = "dead_letter"
    elif job.attempt > 1:
        kind = "retry"
    else:
        kind = "first"
    metrics.JOB_COST.labels(job.workflow, tenant, kind).inc(cost)
    if finish.status in (Status.COMPLETED, Status.DEAD_LETTER):
        metrics.JOB_COST_JOBS.labels(job.workflow, tenant).inc()


def _observe(job: Job, finish: Finish, seconds: float, model: float) -> None:
    workflow = str(job.workflow)
    metrics.MODEL_SECONDS.labels(workflow).observe(model)
    metrics.OTHER_SECONDS.labels(workflow).observe(max(0.0, seconds - model))
    if finish.status == Status.COMPLETED:
        latency = (datetime.now(UTC) - job.created_at).total_seconds()
        metrics.JOB_LATENCY.labels(workflow).observe(max(0.0, latency))
        metrics.JOB_ATTEMPTS.labels(workflow).observe(job.attempt)
    log.info("attempt finished: %s", finish.status, extra={
        "status": str(finish.status), "seconds": round(seconds, 4),
        "model_seconds": round(model, 4),
        "error_code": (finish.error or {}).get("code")})
