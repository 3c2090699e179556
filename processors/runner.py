"""The step runner: the asyncio side of a worker.

For polled messages: decode, claim every job in one statement (what arrives during a claim
joins the next one), wait for a call slot, run each claimed job's
current step with its timeout, then hand the outcome to the group committer, which writes
a few milliseconds' worth of outcomes (status, history, outbox) in ONE transaction and only
then marks their offsets complete. A message whose job is terminal, cancelled or held by a
live lease is acknowledged without a model call.

Fencing: each claim gives the attempt a token (the job's ``lease_version``) that every write
of the attempt carries (heartbeat, side-effect log, step output, artifact key, outcome); the
database takes a write only while the job is still at that version, so an attempt that lost
its lease -- to another worker, or to the same worker id restarted -- records nothing. And a
worker whose heartbeats fail stops its attempts itself before their leases can run out
(``fence_expiring``): no outcome, the offset left pending, the message claimed again later.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import psycopg
from confluent_kafka import Message

from calmq import logs, tracing
from calmq.batching import Batcher
from calmq.codec import EventCodec, decode_message
from calmq.data import Finish, Job, Store
from calmq.data.review_caps import ReviewCaps
from calmq.data.spending import SpendLedger
from calmq.data.steps import SideEffects
from calmq.errors import ContractError, FailureClass, InfrastructureError, LeaseLost, StepFailure
from calmq.failure_codes import ProviderBlocked
from calmq.gateway import ModelClock, Provider, enter_scope, model_clock
from calmq.jobs import Status
from calmq.kafka import header
from calmq.objects import ObjectStore, read_bounded
from calmq.processors import metrics
from calmq.processors.failures import FailureStage, hand_back_blocked
from calmq.processors.offsets import OffsetTracker, Position, headers_of, position_of
from calmq.processors.poison import Poison, PoisonSink
from calmq.processors.slots import CallSlots
from calmq.retrying import RECONNECT, Backoff, retry_forever
from calmq.spending import Holds, SpendCaps
from calmq.storable import UNSTORABLE_OUTPUT, clean, refused, unstorable_outcome
from calmq.workflows import StepContext, StepOutput, Workflow
from calmq.workflows.progress import Progress

__all__ = ["Committer", "RunnerConfig", "StepRunner"]

log = logging.getLogger(__name__)

# Writes an attempt's model usage on its own: (job_id, input, output tokens, cost, calls).
UsageSink = Callable[[str, int, int, float, int], Awaitable[None]]

# An attempt whose lease was last known extended this share of a lease ago is stopped by its
# worker (self-fencing). Heartbeats run every third of a lease, so it takes two failed ones
# in a row; the sixth left is the margin for the cancel to take effect before any other
# worker may claim the job.
FENCE_AT = 5 / 6


@dataclass(frozen=True)
class RunnerConfig:
    worker_id: str
    lease_seconds: float
    tiers: list[tuple[str, float]]
    backoff: Backoff
    step_timeout_seconds: float | None = None  # overrides every step's own timeout
    max_attempts: int | None = None  # overrides every job's own budget
    review_threshold: float = 0.9
    review_deadline_seconds: float = 48 * 3600.0
    # Attempts in their step at once (the worker's --concurrency); interactive ones may
    # exceed it by the reserve, as the consumer lets them.
    concurrency: int = 256
    interactive_reserve: int = 32


class Committer:
    """Group commit of outcomes: those that finish within a few ms share one transaction,
    and only once it committed are their offsets marked complete.

    Up to ``writers`` groups are written at once on separate connections: with hundreds of
    calls ending together, one serial writer became the ceiling of a worker's throughput
    (a group's transaction costs a few ms per outcome), while groups never touch the same
    job row, so they do not contend. A group is written again until the database takes it:
    dropping it would leave its offsets pending for good.
    """

    def __init__(
        self, store: Store, tracker: OffsetTracker, *, window: float = 0.004,
        max_batch: int = 250, writers: int = 4,
    ) -> None:
        self.store = store
        self.tracker = tracker
        # A group the database refuses because of one outcome's data is split until that
        # outcome is alone (calmq.batching); it is then dropped, its offset marked done.
        self._batcher: Batcher[tuple[Finish, Position]] = Batcher(
            "committer", self._write, window=window, max_batch=max_batch, writers=writers,
            retry=RECONNECT, refused=refused, rejected=self._refused)

    def start(self) -> None:
        self._batcher.start()

    def add(self, finish: Finish, position: Position) -> None:
        self._batcher.add((finish, position))

    @property
    def pending(self) -> int:
        """Outcomes not yet durable (queued, or in the transaction being written)."""
        return self._batcher.pending

    async def _write(self, group: list[tuple[Finish, Position]]) -> None:
        started = time.monotonic()
        moved = await self.store.attempts.finish([f for f, _ in group])
        for finish, (tp, offset) in group:
            # Done either way: an outcome the database refused (its attempt lost the lease)
            # belongs to a job that another attempt, with its own message, now holds.
            self.tracker.done(tp, offset)
            if finish.job_id in moved:
                metrics.finished(finish.status, finish.error)
            else:
                log.warning("the outcome of attempt %d of %s was refused: the attempt no "
                            "longer held the job", finish.attempt, finish.job_id)
                metrics.FENCED.labels("stale_outcome").inc()
        metrics.GROUP_WRITE_SECONDS.observe(time.monotonic() - started)
        metrics.GROUP_SIZE.observe(len(group))

    def _refused(self, item: tuple[Finish, Position], error: BaseException) -> None:
        """An outcome the database refused on its own (what ``StepRunner._storable`` did not
        catch): never written again. Its offset is done, so its partition commits on; the
        job's lease runs out and the reaper requeues it."""
        finish, (tp, offset) = item
        log.error("the outcome of attempt %d of %s could not be stored and was dropped: %s",
                  finish.attempt, finish.job_id, error)
        self.tracker.done(tp, offset)

    async def drain(self) -> None:
        await self._batcher.drain()


class StepRunner:
    def __init__(
        self,
        *,
        store: Store,
        codec: EventCodec,
        provider: Provider,
        objects: ObjectStore,
        workflows: dict[str, Workflow],
        tracker: OffsetTracker,
        config: RunnerConfig,
        poison: PoisonSink,
        usage: UsageSink | None = None,
        spend: SpendCaps | None = None,
        allowance: Callable[[uuid.UUID], int | None] | None = None,
    ) -> None:
        self.store = store
        self.spend = spend
        # How many of a tenant's jobs this worker holds at most: what its token quota serves
        # soon (calmq.budget.TenantQuota.allowance; None: no quota). Past it, the tenant's
        # further jobs wait unclaimed (waiting_reason token_quota).
        self.allowance = allowance
        self._held_by: dict[uuid.UUID, int] = {}  # the tenants' jobs in self._running
        self.usage = usage
        self.codec = codec
        self.provider = provider
        self.objects = objects
        self.workflows = workflows
        self.tracker = tracker
        self.config = config
        self.committer = Committer(store, tracker)
        self.slots = CallSlots(config.concurrency, config.interactive_reserve)
        self.poison = poison
        self.progress = Progress(store, objects, config.review_deadline_seconds)
        self.failures = FailureStage(worker_id=config.worker_id, tiers=config.tiers,
                                     backoff=config.backoff, workflows=workflows,
                                     max_attempts=config.max_attempts)
        self._running: dict[uuid.UUID, asyncio.Task[None]] = {}
        # Per running attempt: its fencing token, and when its lease was last known extended
        # (monotonic time at which the claim or heartbeat that extended it was sent).
        self._versions: dict[uuid.UUID, int] = {}
        self._extended: dict[uuid.UUID, float] = {}
        # Attempts this worker stopped itself (self-fencing): their messages are claimed again.
        self._fenced: set[uuid.UUID] = set()
        self._handbacks: set[asyncio.Task[None]] = set()
        # Polled messages waiting for a claim, and the claimers working through them.
        self._inbox: list[Message] = []
        self._claimers: set[asyncio.Task[None]] = set()
        self._claiming = 0  # claimers still looping (their tasks may not have ended yet)
        # Messages whose job was not visible yet when claimed, and how often (see _ahead).
        self._deferred: dict[Position, int] = {}
        self._abandoning = False
        # Review caps (calmq.data.review_caps): the workflows whose jobs can end in review,
        # the pools with a cap (read at most every CAPS_TTL seconds, not once per job), and
        # a lock that makes this worker's hold-then-claim of such jobs take turns, so two
        # claimers do not both see room for the same last review.
        self._review_workflows = sorted(
            name for name, w in workflows.items() if w.review_threshold is not None)
        self._caps: dict[str, int] = {}
        self._caps_read = -float("inf")
        self._cap_turn = asyncio.Lock()
        self.review_caps = ReviewCaps(store)

    def start(self) -> None:
        self.committer.start()

    @property
    def in_flight(self) -> int:
        return len(self._running)

    @property
    def claiming(self) -> bool:
        """Polled messages are still being decoded or claimed."""
        return self._claiming > 0

    def idle(self) -> bool:
        return not self._running and not self._claiming and self.committer.pending == 0

    # Claims in flight at once. Messages that arrive while they run join the next claim: one
    # statement per message when the worker is quiet (no waiting to fill a batch), hundreds
    # per statement when it is busy (the batching group commit does for outcomes).
    CLAIMERS = 2
    CLAIM_BATCH = 500
    # A claim batch is decoded, and its attempts started, this many at a time, with a turn of
    # the event loop between: 500 attempts started in one step run their first steps (a
    # request, at startup a new connection each) in one iteration, which held timers and
    # heartbeats back ~100 ms while a worker filled 5,000 slots (bench longcalls).
    STEP_WORK = 64

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
                await self._handle_batch(batch)
        finally:
            # Counted down in the same step as the empty-inbox check: a submit after it
            # starts a new claimer, so no message is left in the inbox without one.
            self._claiming -= 1

    async def _handle_batch(self, batch: list[Message]) -> None:
        wanted: list[tuple[Message, uuid.UUID]] = []
        steps: dict[uuid.UUID, str] = {}
        workflow_of: dict[uuid.UUID, str] = {}
        whose: dict[uuid.UUID, tuple[str, str]] = {}  # tenant id, priority
        poison: list[Poison] = []
        for i, msg in enumerate(batch):
            if i and i % self.STEP_WORK == 0:
                await asyncio.sleep(0)
            position = position_of(msg)
            try:
                event_type, event = await self._decode(
                    msg.value() or b"", header(headers_of(msg), "eventType"))
                if event_type != "job.requested":
                    raise ContractError(f"{event_type} does not belong on a work topic",
                                        code="unexpected_event")
                wanted.append((msg, uuid.UUID(str(event["job_id"]))))
                steps[wanted[-1][1]] = str(event["step"])
                workflow_of[wanted[-1][1]] = str(event.get("workflow") or "")
                whose[wanted[-1][1]] = (str(event.get("tenant_id") or ""),
                                        str(event.get("priority") or "bulk"))
            except Exception as exc:  # noqa: BLE001 - any unreadable message is poison, not a crash loop
                # (_decode waits out the registry being away: what reaches here is the
                # message's own fault.)
                code = exc.code if isinstance(exc, ContractError) else "undecodable"
                log.warning("poison message at %s: %s", position, exc)
                (topic, partition), offset = position
                poison.append(Poison(topic, partition, offset, msg.key(), msg.value() or b"",
                                     code, str(exc)))
        if poison:
            await retry_forever("sending poison messages to calmq.dlq failed",
                                lambda: self.poison.send(poison))
            for p in poison:
                self.tracker.done((p.topic, p.partition), p.offset)
            metrics.POISON.inc(len(poison))
        if wanted and (self.spend is not None or self.allowance is not None):
            wanted = await self._hold_capped(wanted, whose)
        if not wanted:
            return
        gated = [job_id for _, job_id in wanted
                 if workflow_of.get(job_id) in self._review_workflows]
        if gated and await self._capped():
            async with self._cap_turn:
                held = await retry_forever(
                    "holding jobs for their pool's review cap failed",
                    lambda: self.review_caps.hold(gated, self._review_workflows))
                wanted = self._acknowledge_held(wanted, held)
                started, jobs = await self._claim(wanted, steps)
        else:
            started, jobs = await self._claim(wanted, steps)
        claimed = {job.id: job for job in jobs}
        claimed_ids = set(claimed)  # a second message for one of them is a duplicate
        unclaimed = [job_id for _, job_id in wanted if job_id not in claimed]
        visible = await retry_forever(
            "reading unclaimed jobs failed",
            lambda: self.store.jobs.visible(unclaimed)) if unclaimed else {}
        begun = 0
        for msg, job_id in wanted:
            position = position_of(msg)
            job = claimed.pop(job_id, None)
            if job is None and job_id not in claimed_ids and self._ahead(
                    job_id, steps, workflow_of, visible):
                self._defer(msg, position)
                continue
            self._deferred.pop(position, None)
            if job is None:
                # Terminal, cancelled, or held by a live lease: acknowledge, no model call.
                self.tracker.done(*position)
                metrics.SKIPPED.inc()
                continue
            self._versions[job_id] = job.lease_version
            self._extended[job_id] = started
            task = asyncio.create_task(self._run(job, msg))
            self._running[job_id] = task
            self._held_by[job.tenant_id] = self._held_by.get(job.tenant_id, 0) + 1
            begun += 1
            if begun % self.STEP_WORK == 0:
                await asyncio.sleep(0)  # let these attempts take their first step

    async def _hold_capped(self, wanted: list[tuple[Message, uuid.UUID]],
                           whose: dict[uuid.UUID, tuple[str, str]]
                           ) -> list[tuple[Message, uuid.UUID]]:
        """Jobs of tenants past a spend cap (calmq.spending), or past what their token quota
        serves soon, wait instead of being claimed: their messages are acknowledged once
        the job row says why it waits. What is left is claimed as usual (a job the hold did
        not find may be ahead of this worker's view)."""
        holds = await self.spend.holds() if self.spend is not None else Holds()
        by_reason: dict[str, list[uuid.UUID]] = {}
        taking = dict(self._held_by)  # what each tenant holds with this batch's jobs
        for _, job_id in wanted:
            tenant, priority = whose.get(job_id, ("", "bulk"))
            try:
                tenant_id = uuid.UUID(tenant)
            except ValueError:
                continue
            if job_id in self._running:
                continue
            reason = holds.reason(tenant_id, priority)
            # Interactive work is never held for the quota (it does not wait at the quota
            # either: calmq.budget.TenantQuota.acquire), and bulk cannot crowd it out.
            if reason is None and self.allowance is not None and priority != "interactive":
                allowed = self.allowance(tenant_id)
                if allowed is not None and taking.get(tenant_id, 0) >= allowed:
                    reason = "token_quota"
                else:
                    taking[tenant_id] = taking.get(tenant_id, 0) + 1
            if reason is not None:
                by_reason.setdefault(reason, []).append(job_id)
        if not by_reason:
            return wanted
        ledger = SpendLedger(self.store)
        held: set[uuid.UUID] = set()
        for reason, ids in by_reason.items():
            def hold(ids: list[uuid.UUID] = ids, reason: str = reason
                     ) -> Awaitable[list[uuid.UUID]]:
                return ledger.hold(ids, reason, {})
            held.update(await retry_forever("holding waiting jobs failed", hold))
        rest = []
        for msg, job_id in wanted:
            if job_id in held:
                self.tracker.done(*position_of(msg))
                metrics.HELD.labels(whose.get(job_id, ("", ""))[1] or "bulk").inc()
            else:
                rest.append((msg, job_id))
        return rest

    async def _claim(self, wanted: list[tuple[Message, uuid.UUID]],
                     steps: dict[uuid.UUID, str]) -> tuple[float, list[Job]]:
        ids = {job_id for _, job_id in wanted if job_id not in self._running}
        started = time.monotonic()  # the leases the claim grants start after this
        if not ids:
            return started, []
        jobs = await retry_forever("claiming a batch failed", lambda: self.store.jobs.claim(
            list(ids), self.config.worker_id, self.config.lease_seconds, steps))
        metrics.CLAIM_SECONDS.observe(time.monotonic() - started)
        return started, jobs

    CAPS_TTL = 1.0

    async def _capped(self) -> bool:
        """Whether any pool has a review cap (cached for CAPS_TTL seconds)."""
        now = time.monotonic()
        if now - self._caps_read >= self.CAPS_TTL:
            self._caps = await retry_forever("reading the review caps failed",
                                             self.review_caps.capped_pools)
            self._caps_read = now
        return bool(self._caps)

    def _acknowledge_held(self, wanted: list[tuple[Message, uuid.UUID]],
                          held: set[uuid.UUID]) -> list[tuple[Message, uuid.UUID]]:
        """Acknowledge the messages of jobs held for their pool's review cap: the job waits
        in queued, and the release pass re-publishes it (a message left pending for hours
        would block its partition's commits instead). The rest go on to the claim."""
        rest = []
        for msg, job_id in wanted:
            if job_id in held:
                position = position_of(msg)
                self._deferred.pop(position, None)
                self.tracker.done(*position)
                metrics.REVIEW_CAP_HELD.inc()
            else:
                rest.append((msg, job_id))
        return rest

    async def _decode(self, data: bytes, event_type: str | None) -> tuple[str, dict[str, Any]]:
        """Decode a message (calmq's Avro, or the Debezium connector's JSON named by its
        ``eventType`` header); a registry that is away is waited out, never taken for poison.

        A schema the codec has not cached is fetched in a thread (the registry call blocks,
        and heartbeats and commits must keep running meanwhile)."""
        knows = getattr(self.codec, "knows", None)

        async def once() -> tuple[str, dict[str, Any]]:
            if knows is None or knows(data):
                return decode_message(self.codec, data, event_type)
            return await asyncio.to_thread(decode_message, self.codec, data, event_type)

        return await retry_forever("the schema registry is unavailable", once,
                                   retry_on=(InfrastructureError,))

    def _ahead(self, job_id: uuid.UUID, steps: dict[uuid.UUID, str],
               workflow_of: dict[uuid.UUID, str],
               visible: dict[uuid.UUID, tuple[str, str]]) -> bool:
        """Whether a message is ahead of what this worker can see of its job.

        The relay publishes a transaction once its commit record is decoded from the WAL,
        which can be a moment before the transaction is visible to other sessions: a
        worker that dispatches at once may then claim a job whose row it cannot see yet
        (or, for the next step of a workflow, still sees at the previous step). Such a
        message is claimed again shortly, never acknowledged as stale.
        """
        seen = visible.get(job_id)
        if seen is None:
            return True
        step, status = seen
        wanted = steps.get(job_id)
        if step == wanted and status in ("queued", "retrying"):
            # Claimable now, so the claim's snapshot (taken a moment before this read)
            # did not see it yet; another worker's claim would have made it running.
            return True
        if step == wanted and status == "dead_letter":
            # A redrive's request can outrun the redrive's commit the same way: the worker
            # still sees the dead letter. Acknowledging it would leave the redriven job
            # queued with no message (until the sweeper), so it is claimed again shortly;
            # a true stale duplicate of a dead letter only costs its few deferrals (~4 s).
            return True
        workflow = self.workflows.get(workflow_of.get(job_id, ""))
        if workflow is None:
            return False
        order = [s.name for s in workflow.steps]
        return step in order and wanted in order and order.index(step) < order.index(wanted)

    # A job still out of sight after this many claims (~4 s) is acknowledged: its row was
    # deleted (a retention sweep), since a published job's row is committed with its event.
    MAX_DEFERRALS = 10

    def _defer(self, msg: Message, position: Position) -> None:
        tries = self._deferred.get(position, 0) + 1
        if tries > self.MAX_DEFERRALS:
            self._deferred.pop(position, None)
            log.warning("no job row for the message at %s after %d claims; acknowledged",
                        position, tries - 1)
            self.tracker.done(*position)
            metrics.SKIPPED.inc()
            return
        self._deferred[position] = tries
        metrics.CLAIMS_DEFERRED.inc()
        asyncio.get_running_loop().call_later(min(0.005 * 2 ** tries, 1.0), self.submit, [msg])

    async def _run(self, job: Job, msg: Message) -> None:
        position = position_of(msg)
        topic = position[0][0]
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
                finish = await self._attempt(job, topic)
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
            finish = self.failures.outcome(job, topic, StepFailure(
                "the attempt's outcome could not be recorded", code="unhandled_exception",
                failure_class=FailureClass.BUG))
        except asyncio.CancelledError:
            if self._abandoning:
                # Abandoned at shutdown: leave the offset pending so the partition's next
                # owner reads the message again.
                pass
            elif job.id in self._fenced:
                # Stopped by this worker before its lease could run out (heartbeats failing):
                # no outcome, and the offset stays pending; the message is claimed again
                # once the database answers (the claim then decides who runs it).
                self._hand_back(job, msg)
            else:
                # The lease was lost (cancelled job, or a reaper requeued it): discard the
                # result and acknowledge.
                self.tracker.done(*position)
            # No outcome will carry them: the tokens the provider counted are still spent.
            await self._record_usage(job, clock)
            if clock.cost_usd:
                metrics.JOB_COST.labels(job.workflow, str(job.tenant_id), "abandoned").inc(
                    clock.cost_usd)
            return
        finally:
            self._running.pop(job.id, None)
            self._versions.pop(job.id, None)
            self._extended.pop(job.id, None)
            left = self._held_by.get(job.tenant_id, 1) - 1
            if left > 0:
                self._held_by[job.tenant_id] = left
            else:
                self._held_by.pop(job.tenant_id, None)
        finish.usage = {"model_calls": clock.calls, "input_tokens": clock.input_tokens,
                        "output_tokens": clock.output_tokens, "cost_usd": clock.cost_usd}
        self._observe(job, finish, time.monotonic() - started, clock.seconds)
        self._cost(job, finish, clock.cost_usd)
        self.committer.add(finish, position)

    async def _hand_back_blocked(self, job: Job, position: Position,
                                 blocked: ProviderBlocked) -> None:
        """Issue 26: the provider-blocked hand-back; the offset is done once the job row
        says it waits (its release writes a fresh job.requested)."""
        await retry_forever("handing back a job whose provider is blocked failed",
                            lambda: hand_back_blocked(self.store, job, self.config.worker_id,
                                                      blocked))
        self.tracker.done(*position)

    async def _record_usage(self, job: Job, clock: ModelClock) -> None:
        if not clock.calls or self.usage is None:
            return
        try:
            await self.usage(str(job.id), clock.input_tokens, clock.output_tokens,
                             clock.cost_usd, clock.calls)
        except Exception:  # metering must not keep a stopped attempt from ending
            log.exception("recording the usage of an abandoned attempt of %s failed", job.id)

    @staticmethod
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

    @staticmethod
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

    async def _attempt(self, job: Job, topic: str) -> Finish:
        """The attempt's outcome, as it will be committed (by the committer or the batch
        poller): held to what PostgreSQL can store first (``_storable``)."""
        return self._storable(job, topic, await self._outcome(job, topic))

    def _storable(self, job: Job, topic: str, finish: Finish) -> Finish:
        """``finish``, or, if it holds text PostgreSQL refuses (a NUL or a lone surrogate in
        the step's output, its error or an event: calmq.storable), the step's failure as
        ``input`` / ``unstorable_output`` with a message that holds none of that text. The
        group commit would otherwise fail on it, with every outcome beside it."""
        found = unstorable_outcome(finish)
        if found is None:
            return finish
        metrics.UNSTORABLE.inc()
        message = f"the step's result holds text that cannot be stored: {found}"
        if finish.error is not None:
            message += f" (its error was: {clean(str(finish.error.get('message', '')))})"
        log.warning("step %s of job %s: %s", job.step, job.id, message)
        return self.failures.outcome(job, topic, StepFailure(
            message, code=UNSTORABLE_OUTPUT, failure_class=FailureClass.INPUT))

    async def _outcome(self, job: Job, topic: str) -> Finish:
        started = time.monotonic()
        workflow = self.workflows.get(job.workflow)
        try:
            if workflow is None:
                raise StepFailure(f"no workflow named {job.workflow!r} on this worker",
                                  code="unknown_workflow", failure_class=FailureClass.INPUT)
            step = workflow.step(job.step)
            deadline = job.deadline_at
            if deadline is not None and deadline < datetime.now(UTC):
                raise StepFailure("the job deadline passed before it could run",
                                  code="deadline_exceeded", failure_class=FailureClass.DEADLINE)
            # A step whose output is recorded already is not run again (redelivery, replay).
            recorded = await self.progress.recorded(job, workflow)
            replayed = self.progress.replay(step, recorded)
            if replayed is not None:
                output = replayed
            else:
                data = self.progress.step_input(workflow, step, recorded)
                if data is None:
                    data = await self._input(job, workflow)
                if log.isEnabledFor(logging.DEBUG):  # the formatter redacts "input" fields
                    log.debug("step %s starts", step.name, extra={"input": data})
                # The effect log of this attempt: its records carry the fencing token.
                effects = SideEffects(self.store, self.config.worker_id, job.lease_version)
                ctx = StepContext(str(job.id), str(job.tenant_id), step.name,
                                  job.attempt, self.provider, self.objects, effects,
                                  priority=job.priority, workflow=job.workflow,
                                  lease_version=job.lease_version)
                enter_scope(ctx.call_scope())  # the budget's priority, the meter's labels
                timeout = self.config.step_timeout_seconds or step.timeout_seconds
                # Claimed ahead, a job may wait here for a slot; its timeout starts after.
                await self.slots.acquire(job.priority)
                try:
                    async with asyncio.timeout(timeout):
                        output = await step.run(ctx, data)
                except TimeoutError:
                    raise StepFailure(
                        f"the step ran past its {timeout:g} s timeout", code="timeout",
                        failure_class=FailureClass.TRANSIENT) from None
                finally:
                    self.slots.release()
                output = StepOutput(step.check_output(output.artifact), output.confidence,
                                    output.input_tokens, output.output_tokens)
        except ProviderBlocked:
            raise  # not the job's attempt: handed back by _run (hand_back_blocked)
        except StepFailure as failure:
            return self.failures.outcome(job, topic, failure)
        except ContractError as exc:
            return self.failures.outcome(job, topic, StepFailure(exc.message, code=exc.code,
                                                        failure_class=FailureClass.INPUT))
        except (asyncio.CancelledError, LeaseLost):
            raise
        except Exception as exc:  # a step that raised something it did not classify
            if _infrastructure(exc):
                # Reading the input, recording progress or a side effect met the database
                # or the object store away: not the job's fault, so retried, not a bug.
                log.warning("step %s of job %s: infrastructure failed: %s", job.step, job.id,
                            exc)
                return self.failures.outcome(job, topic, StepFailure(
                    f"infrastructure unavailable: {type(exc).__name__}",
                    code="infrastructure_error", failure_class=FailureClass.TRANSIENT))
            log.exception("step %s of job %s raised", job.step, job.id)
            return self.failures.outcome(job, topic, StepFailure(f"{type(exc).__name__}: {exc}",
                                                        code="unhandled_exception",
                                                        failure_class=FailureClass.BUG))
        finally:
            metrics.STEP_SECONDS.observe(time.monotonic() - started)
        assert workflow is not None
        try:
            return await self._succeeded(job, workflow, output)
        except (asyncio.CancelledError, LeaseLost):
            raise
        except Exception as exc:  # noqa: BLE001 - every attempt ends in one outcome
            # After the model call: writing the artifact or step output failed. The store
            # being away is not the job's fault (retried); anything else is a bug.
            return self.failures.outcome(job, topic, _after_step(job, exc))

    async def _input(self, job: Job, workflow: Workflow) -> dict[str, Any]:
        if job.input is not None:
            return job.input
        if job.input_ref:
            # Input by reference obeys the workflow's rules like inline input (the API
            # checked type and size already; a ContractError here is the job's fault).
            accepts = workflow.accepts_reference()
            if accepts.streams:  # the first step reads the object itself, in chunks
                return {"input_ref": job.input_ref}
            raw = await read_bounded(self.objects, job.input_ref, accepts.max_bytes)
            try:
                loaded = json.loads(raw)
            except ValueError:
                loaded = None
            if isinstance(loaded, dict):
                return workflow.validate_input(loaded)
            # A text file: the text of the workflow's input, held to the same model.
            return workflow.validate_input({"text": raw.decode("utf-8", "replace")})
        raise StepFailure("the job has neither input nor input_ref", code="missing_input",
                          failure_class=FailureClass.INPUT)

    async def _succeeded(self, job: Job, workflow: Workflow, out: StepOutput) -> Finish:
        # Record the output with the job and move it on (next step, review or completed) in
        # the same transaction: calmq/workflows/progress.py.
        return await self.progress.succeeded(job, workflow, out, self.config.worker_id)

    async def abandon(self) -> int:
        """Stop every in-flight attempt (the grace period ran out) and hand its lease back.

        The offsets stay uncommitted, so the next owner of the partition reads the message
        again; with the lease released at once it claims the job straight away (history:
        ``requeued_after_restart``, ``running``) instead of waiting for the lease to expire.
        """
        self._abandoning = True
        tasks = dict(self._running)
        leases = {job_id: self._versions[job_id] for job_id in tasks}
        for task in tasks.values():
            task.cancel()
        if tasks:
            await asyncio.gather(*tasks.values(), return_exceptions=True)
            try:
                await self.store.jobs.release_leases(leases, self.config.worker_id)
            except Exception:
                log.exception("releasing %d leases failed", len(tasks))
        return len(tasks)

    # -- leases -------------------------------------------------------------------------

    async def heartbeat(self) -> None:
        """Extend the leases of running jobs; abort the ones this worker no longer holds."""
        leases = {job_id: self._versions[job_id] for job_id in self._running
                  if job_id not in self._fenced}
        if not leases:
            return
        sent = time.monotonic()  # the extended leases run from after this
        held = await self.store.jobs.heartbeat(leases, self.config.worker_id,
                                               self.config.lease_seconds)
        for job_id, version in leases.items():
            task = self._running.get(job_id)
            if task is None or self._versions.get(job_id) != version:
                continue  # ended meanwhile (or its job was claimed again since)
            if job_id in held:
                self._extended[job_id] = sent
            elif job_id not in self._fenced:
                task.cancel()
                metrics.ABORTED.inc()

    async def fence_expiring(self) -> int:
        """Self-fencing: stop every attempt whose lease may run out soon because this worker
        could not extend it (its heartbeats failed: the database is away or too slow), before
        any other worker may claim the job. Such an attempt ends with no outcome, its slot is
        freed and its offset stays pending: its message goes back to the claim, which runs
        once the database answers and decides who runs the job. Returns how many it stopped.
        """
        limit = self.config.lease_seconds * FENCE_AT
        now = time.monotonic()
        stopped = 0
        for job_id, task in list(self._running.items()):
            since = now - self._extended.get(job_id, now)
            if since < limit or job_id in self._fenced:
                continue
            self._fenced.add(job_id)
            task.cancel()
            stopped += 1
            metrics.FENCED.labels("heartbeat_failed").inc()
            log.warning("stopping attempt of %s: its lease was last extended %.1f s ago "
                        "(lease %.1f s) and may be taken over", job_id, since,
                        self.config.lease_seconds, extra={"job_id": str(job_id)})
        return stopped

    def _hand_back(self, job: Job, msg: Message) -> None:
        """Claim a self-fenced attempt's message again, once its lease is handed back."""
        async def hand_back() -> None:
            try:
                # Expire the lease at once if it is still this attempt's (the database
                # answered again before it ran out), so the claim need not wait for it.
                await retry_forever(
                    "handing back the lease of a stopped attempt failed",
                    lambda: self.store.jobs.release_leases({job.id: job.lease_version},
                                                           self.config.worker_id))
            finally:
                self._fenced.discard(job.id)
            self.submit([msg])

        task = asyncio.create_task(hand_back())
        self._handbacks.add(task)
        task.add_done_callback(self._handbacks.discard)


def _infrastructure(exc: BaseException) -> bool:
    """A part calmq depends on failed (not the job, not our code): a full disk (OSError), the
    database away, or S3 failing (botocore's errors, matched by module so the worker needs no
    boto3 import when it uses file://)."""
    return (isinstance(exc, OSError | InfrastructureError | psycopg.OperationalError)
            or type(exc).__module__.startswith("botocore"))


def _after_step(job: Job, exc: Exception) -> StepFailure:
    """The failure of an attempt whose step ran but whose result could not be recorded."""
    if _infrastructure(exc):
        log.warning("recording the result of %s failed: %s", job.id, exc)
        return StepFailure(f"the result could not be stored: {type(exc).__name__}",
                           code="artifact_write_failed", failure_class=FailureClass.TRANSIENT)
    log.exception("recording the result of %s raised", job.id)
    return StepFailure(f"{type(exc).__name__}: {exc}", code="unhandled_exception",
                       failure_class=FailureClass.BUG)
