"""The batch lane's processor (`calmq batcher`): the batcher packs batch-lane jobs into
provider batches, the poller collects each batch's results when it ends.

The batcher consumes ``calmq.<pool>.batch`` with the worker's own consumer and stages
(processors/pipeline.py: claims with leases, poison, deferral, heartbeats, the step's input
and recorded outputs): only its attempt's provider and its admission gates differ.
``BatchPacker.complete`` does not call the model: it builds the request body the online call
would send, adds it to the pack of its model and endpoint, and waits. A pack is flushed when
it reaches the provider's request or byte limit, or the settable size or age: its batch is
recorded under calmq's key and its jobs move to the batch's lease in ONE transaction
(``Batches.record``), and only then are the messages' offsets marked done (their waiting
attempts are cancelled, which acknowledges them); the batch is created at the provider with
that key in its metadata, and its id and each job's ``batched`` event are recorded
(``Batches.submitted``).

Spend caps hold before the bill arrives: the results, and with them the cost, come back
hours after a pack is sent, so that same transaction reserves each request's estimated cost
(the prompt's estimated tokens plus its max output tokens, at the batch price) against its
tenant's and the fleet's caps (calmq.spending); a request that does not fit is not sent,
and its job waits queued with the cap's reason, uncounted, as online work does. Results
settle the reservation with the real cost; a batch that ends without them releases it. A
workflow's ``concurrency_limit`` holds here as online (the concurrency-key gate; the fleet's
release pass re-publishes what it held): a packed job counts as running until its result
settles.

Poller. One poller at a time holds a batch (a lease on its row). A batch still ``creating``
whose batcher died is found again at the provider by its key (adopted) or created then;
never twice. A batch that ended is collected: its results are streamed in chunks and each
job is settled by the worker's own attempt stage (processors/attempt.py), with a provider
that answers from the result (``ReplyBook``): the same step function validates the output,
the same progress code writes the artifact or asks for a review, the same failure stage
picks retry or dead letter, and the same group commit writes status, history and outbox in
one transaction. A request
that failed transiently goes back to the batch topic (via a retry tier) for a later batch;
one the provider did not run (batch expired or cancelled) too, unless its deadline would then
be missed: that job continues online.

The process runs under the same lifecycle as a worker (calmq.supervision.Lifecycle): on
SIGTERM the packer flushes what it holds, the stages drain within the grace period, and a
critical side task that stops ends the process with an error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from confluent_kafka import Producer
from prometheus_client import Counter, Gauge, Histogram

from calmq import topics
from calmq.calls import ProviderGate, estimate_prompt_tokens
from calmq.calls.batch_apis import (
    BatchClient,
    BatchRefused,
    BatchResult,
    BatchView,
    LineError,
    custom_id,
    open_batch_client,
)
from calmq.calls.pricing import batch_cost_usd, cost_usd
from calmq.calls.stack import open_gate
from calmq.calls.wires import ModelReply, classify_status, current_clock, model_clock
from calmq.codec import make_codec, registry_config
from calmq.data import Finish, Job, Store
from calmq.data.batches import BatchRequestRow, OpenBatch, batch_owner
from calmq.data.concurrency import ConcurrencyKeys
from calmq.data.spending import Charge, SpendLedger
from calmq.errors import FailureClass, InfrastructureError, StepFailure
from calmq.failure_codes import ProviderBlocked, failure, spec
from calmq.group_commit import GroupCommitter
from calmq.job_costs import count_accepted
from calmq.kafka import consumer_config, producer_config, service_connection
from calmq.lanes import ONLINE
from calmq.objects import open_object_store
from calmq.processors import metrics
from calmq.processors.admission import (
    ConcurrencyKeyGate,
    Gate,
    ReviewCapGate,
    SpendCapGate,
    concurrency_limits,
    review_workflows,
    statement_gates,
)
from calmq.processors.attempt import Attempt
from calmq.processors.consumer import ParallelConsumer
from calmq.processors.intake import Intake
from calmq.processors.leases import Leases
from calmq.processors.pipeline import Pipeline, failure_stage
from calmq.processors.poison import PoisonSink
from calmq.processors.reaper import schedule_spend_release
from calmq.processors.slots import CallSlots
from calmq.retrying import RECONNECT, retry_forever
from calmq.settings import Settings
from calmq.spending import SpendCaps, spend_caps_from_settings
from calmq.storable import refused
from calmq.supervision import Lifecycle
from calmq.workflows import Workflow, load_workflows

__all__ = ["BatchLane", "BatchPacker", "Poller", "ReplyBook"]

log = logging.getLogger(__name__)

OPEN_BATCHES = Gauge("calmq_batches_open", "Provider batches not yet collected")
OLDEST_BATCH = Gauge("calmq_batch_oldest_age_seconds", "Age of the oldest open provider batch")
BATCH_JOBS = Gauge("calmq_batch_jobs", "Job attempts in provider batches (open, or settled "
                   "in the last hour) by state", ["state"])
PACKED = Counter("calmq_batch_jobs_packed_total", "Job attempts packed into provider batches")
CREATED = Counter("calmq_batches_created_total", "Provider batches created", ["provider"])
ADOPTED = Counter("calmq_batches_adopted_total",
                  "Batches found again at the provider after their batcher died")
SETTLED = Counter("calmq_batch_jobs_settled_total", "Batch results settled", ["result"])
TURNAROUND = Histogram("calmq_batch_turnaround_seconds",
                       "From a batch's creation to its collection",
                       buckets=(1, 5, 30, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 86400))
COST = Counter("calmq_batch_cost_usd_total", "Cost of batched requests at the batch price",
               ["tenant", "model"])
ONLINE_COST = Counter("calmq_batch_online_equivalent_usd_total",
                      "What the batched requests' tokens would have cost online",
                      ["tenant", "model"])
SAVINGS = Counter("calmq_batch_savings_usd_total",
                  "Online-equivalent cost minus batch cost of batched requests",
                  ["tenant", "model"])
DELETED = Counter("calmq_batch_files_deleted_total",
                  "Ended provider batches whose files (or batch) calmq deleted at the provider")
UNREADABLE = Counter("calmq_batch_unreadable_lines_total",
                     "Lines of a provider's results file that named no request (skipped)")
SPEND_HELD = Counter("calmq_batch_jobs_spend_held_total",
                     "Packed requests not sent because their tenant or the fleet reached a "
                     "spend cap with what is spent and reserved (their jobs wait, uncounted)",
                     ["reason"])
RESERVED = Gauge("calmq_batch_reserved_usd",
                 "Estimated cost of batched requests not yet settled, reserved against the "
                 "spend caps")

_SETTLE_CHUNK = 200


# -- batcher ------------------------------------------------------------------------------

@dataclass
class _Waiting:
    job: Job
    custom_id: str
    body: dict[str, Any]
    line: bytes
    tokens: int
    cost: float  # the estimate reserved against the spend caps (batch price)
    future: asyncio.Future[ModelReply]


@dataclass
class _Pack:
    model: str
    endpoint: str
    items: dict[uuid.UUID, _Waiting] = field(default_factory=dict)
    size: int = 0
    tokens: int = 0
    started: float = field(default_factory=time.monotonic)

    def add(self, item: _Waiting) -> None:
        if not self.items:
            self.started = time.monotonic()
        self.items[item.job.id] = item
        self.size += len(item.line)
        self.tokens += item.tokens

    def remove(self, job_id: uuid.UUID) -> None:
        item = self.items.pop(job_id, None)
        if item is not None:
            self.size -= len(item.line)
            self.tokens -= item.tokens


class BatchPacker:
    """The batcher's provider: a model call becomes a request in the pack of its model and
    endpoint; the call waits until its batch is recorded (then the attempt is cancelled,
    which acknowledges its message) or the job is lost (cancelled, lease taken)."""

    def __init__(self, client: BatchClient, settings: Settings, store: Store,
                 worker_id: str) -> None:
        self.client = client
        self.settings = settings
        self.store = store
        self.worker_id = worker_id
        self.packs: dict[tuple[str, str], _Pack] = {}
        # The stages whose attempts call this provider: which job an attempt runs, and how
        # to end it (BatchLane sets it).
        self.pipeline: Pipeline | None = None
        max_requests, max_bytes = client.limits
        self.max_requests = min(max_requests, settings.batch_max_requests)
        self.max_bytes = min(max_bytes, settings.batch_max_bytes)
        self._flushing: set[asyncio.Task[None]] = set()
        self._wake = asyncio.Event()
        # The provider's fleet-wide state (BatchLane sets it): a blocked provider gets no
        # request packed; the attempt is handed back uncounted (ProviderBlocked).
        self.gate: ProviderGate | None = None
        # The spend caps each pack reserves against when it is recorded (BatchLane sets it).
        self.spend: SpendCaps | None = None

    async def complete(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
                       response_schema: dict[str, Any] | None = None) -> ModelReply:
        if self.gate is not None:
            await self.gate.admit()
        job = self._job(job_id)
        if job is None:
            raise StepFailure("a batch-lane step called the model outside its attempt",
                              code="batch_unknown_job", failure_class=FailureClass.BUG)
        body = self.client.request_body(messages=messages, job_id=job_id,
                                        max_tokens=max_tokens, response_schema=response_schema)
        cid = custom_id(job.id, job.attempt)
        line = self.client.line(cid, body)
        model = str(body.get("model") or self.client.model)
        # The cost reserved against the spend caps: the prompt estimated as the online
        # budget estimates it, and the answer at its bound, at the batch price.
        cost = batch_cost_usd(self.settings.prices, self.client.kind, model,
                              estimate_prompt_tokens(messages), max_tokens,
                              table=self.settings.prices_table)
        # Estimated like the budget does: the prompt's bytes / 4 plus the answer's bound.
        item = _Waiting(job, cid, body, line, len(line) // 4 + max_tokens, cost,
                        asyncio.get_running_loop().create_future())
        key = (model, self.client.endpoint)
        pack = self.packs.setdefault(key, _Pack(*key))
        if pack.items and (len(pack.items) >= self.max_requests
                           or pack.size + len(line) > self.max_bytes):
            self._take(key)  # full: flushed at once, this one starts the next pack
            pack = self.packs[key] = _Pack(*key)
        pack.add(item)
        if len(pack.items) >= self.max_requests:
            self._wake.set()
        try:
            return await item.future
        finally:
            current = self.packs.get(key)
            if current is not None:
                current.remove(job.id)  # lost before its batch was recorded: not sent

    def _job(self, job_id: str) -> Job | None:
        """The job of the running attempt ``job_id`` (None: not running here any more)."""
        try:
            ident = uuid.UUID(job_id)
        except ValueError:
            return None
        return self.pipeline.job(ident) if self.pipeline is not None else None

    def _take(self, key: tuple[str, str]) -> None:
        pack = self.packs.pop(key, None)
        if pack is None or not pack.items:
            return
        task = asyncio.create_task(self._flush(pack))
        self._flushing.add(task)
        task.add_done_callback(self._flushing.discard)

    async def run(self, stop: asyncio.Event) -> None:
        """Flush packs as they fill or age, until ``stop``; then flush what is left."""
        while not stop.is_set():
            self._wake.clear()
            with_timeout = min(1.0, self.settings.batch_max_age_seconds / 4)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), with_timeout)
            now = time.monotonic()
            for key, pack in list(self.packs.items()):
                if pack.items and (len(pack.items) >= self.max_requests
                                   or now - pack.started >= self.settings.batch_max_age_seconds):
                    self._take(key)
        for key in list(self.packs):
            self._take(key)
        await self.drain()

    async def flush_all(self) -> None:
        for key in list(self.packs):
            self._take(key)
        await self.drain()

    async def drain(self) -> None:
        while self._flushing:
            await asyncio.gather(*list(self._flushing), return_exceptions=True)

    async def _room(self, pack: _Pack) -> bool:
        limit = self.settings.batch_enqueued_tokens_limit
        if not limit:
            return True
        held = await self.store.batches.enqueued_tokens(self.client.kind, pack.model)
        return held == 0 or held + pack.tokens <= limit

    async def _flush(self, pack: _Pack) -> None:
        s = self.settings
        try:
            if not await self._room(pack):
                log.info("the provider's batch queue for %s is full (%d tokens): %d jobs wait",
                         pack.model, s.batch_enqueued_tokens_limit, len(pack.items))
                self._put_back(pack)
                return
            key = uuid.uuid4()
            items = list(pack.items.values())
            rows = [BatchRequestRow(i.job.id, i.job.attempt, i.custom_id, i.body,
                                    i.job.lease_version, i.cost) for i in items]
            # Reserved oldest job first: a cap reached mid-pack holds the newest.
            charges = [Charge(i.job.id, i.job.tenant_id, i.job.priority, i.cost)
                       for i in sorted(items, key=lambda i: (i.job.created_at, i.job.id))]
            spend = self.spend
            moved, refused = await self.store.batches.record(
                key=key, provider=self.client.kind, model=pack.model, endpoint=pack.endpoint,
                pool=s.pool, worker=self.worker_id, rows=rows, input_bytes=pack.size,
                enqueued_tokens=pack.tokens, lease_seconds=s.batch_lease_seconds,
                hold_seconds=s.batch_completion_window_seconds + s.batch_deadline_margin_seconds,
                charges=charges, admit=spend.admit if spend is not None else None,
                fleet_capped=spend is not None and spend.fleet_capped)
        except Exception as exc:  # noqa: BLE001 - the jobs keep their leases; tried again
            log.warning("recording a batch of %d jobs failed (%s); trying again",
                        len(pack.items), exc)
            self._put_back(pack)
            return
        # Recorded: the jobs belong to the batch. Their attempts end here, which marks their
        # offsets done (a job that was not moved was lost meanwhile, or waits for a spend
        # cap: acknowledged too, its job waits in the database).
        self._release(items)
        PACKED.inc(len(moved))
        if refused:
            for reason in refused.values():
                SPEND_HELD.labels(reason).inc()
            metrics.HELD.labels("bulk").inc(len(refused))
            log.info("%d of %d packed requests wait for a spend cap (%s)", len(refused),
                     len(items), ", ".join(sorted(set(refused.values()))))
        if not moved:
            return
        lines = [i.line for i in items if i.job.id in moved]
        # The batch's lease is kept while the create runs (a 200 MB upload takes a while):
        # a poller takes a ``creating`` batch only once its batcher stopped keeping it.
        try:
            with self._keeping(key):
                view = await self.client.create(lines, str(key))
        except InfrastructureError as exc:
            # Left ``creating``: the poller looks for it by its key once this lease lapses,
            # and creates it then if the provider does not have it (or, refused, hands its
            # jobs back: Poller._refused). A refused key blocks the provider at once, so
            # no further pack is sent meanwhile.
            log.warning("creating batch %s at the provider failed: %s", key, exc)
            if isinstance(exc, BatchRefused) and self.gate is not None and spec(
                    exc.failure.code, exc.failure.failure_class).pauses:
                await self.gate.failed(exc.failure)
            return
        CREATED.labels(self.client.kind).inc()
        await retry_forever("recording a created batch failed", lambda: (
            self.store.batches.submitted(key, view.provider_id, view.status,
                                         s.batch_poll_interval_seconds)))
        log.info("batch %s (%s) created with %d requests", view.provider_id, key, len(moved))

    def _keeping(self, key: uuid.UUID) -> contextlib.AbstractContextManager[None]:
        """The batch's lease kept by the attempts' leases (processors/leases.py)."""
        if self.pipeline is None:
            return contextlib.nullcontext()
        return self.pipeline.leases.keeping_batch(key)

    def _put_back(self, pack: _Pack) -> None:
        target = self.packs.setdefault((pack.model, pack.endpoint), _Pack(pack.model,
                                                                          pack.endpoint))
        for item in pack.items.values():
            if self._job(str(item.job.id)) is not None:  # still waits (not lost meanwhile)
                target.add(item)
        target.started = min(target.started, pack.started)

    def _release(self, items: list[_Waiting]) -> None:
        """The packed attempts end with no outcome: their messages are acknowledged."""
        if self.pipeline is not None:
            for item in items:
                self.pipeline.stop(item.job.id)

    async def close(self) -> None:
        await self.client.close()


# -- poller -------------------------------------------------------------------------------

class ReplyBook:
    """The settling runner's provider: answers a step's model call from its batch result,
    metered at the batch price (the online-equivalent cost is kept beside it). A result
    refused for the key (401, 403, a model the account cannot use, billing) is read as the
    online call reads it: the provider and model block fleet-wide (``gate``) and the job is
    handed back, uncounted (``ProviderBlocked``)."""

    def __init__(self, client: BatchClient, settings: Settings,
                 gate: ProviderGate | None = None) -> None:
        self.client = client
        self.settings = settings
        self.gate = gate
        self.results: dict[str, BatchResult] = {}
        self.costs: dict[str, tuple[int, int, float, float]] = {}

    async def complete(self, *, messages: list[dict[str, str]], job_id: str, max_tokens: int,
                       response_schema: dict[str, Any] | None = None) -> ModelReply:
        result = self.results.pop(job_id, None)
        if result is None:
            raise StepFailure("the step made a second model call; the batch lane serves one "
                              "call per step", code="batch_multi_call",
                              failure_class=FailureClass.BUG)
        if result.failure is not None:
            if self.gate is not None and spec(result.failure.code,
                                              result.failure.failure_class).pauses:
                raise await self.gate.failed(result.failure)
            raise result.failure
        assert result.reply is not None
        reply = result.reply
        prices, kind, model = self.settings.prices, self.client.kind, self.client.model
        cached = reply.cached_input_tokens
        table = self.settings.prices_table
        cost = batch_cost_usd(prices, kind, model, reply.input_tokens, reply.output_tokens,
                              cached_input_tokens=cached, table=table)
        online = cost_usd(prices, kind, model, reply.input_tokens, reply.output_tokens,
                          cached_input_tokens=cached, table=table)
        self.costs[job_id] = (reply.input_tokens, reply.output_tokens, cost, online)
        clock = current_clock()
        if clock is not None:
            clock.add_usage(reply.input_tokens, reply.output_tokens, cost)
        return reply

    async def close(self) -> None:
        return None


class Poller:
    """Follows each batch a pass takes: creates or adopts one left ``creating``, cancels one
    none of whose jobs still waits, collects one that ended, and deletes at the provider
    what it keeps of an ended batch (its files, or the batch)."""

    def __init__(self, *, store: Store, client: BatchClient,
                 settler: Callable[[str], Attempt], book: ReplyBook, settings: Settings,
                 worker_id: str, leases: Leases, gate: ProviderGate | None = None) -> None:
        self.store = store
        # Keeps the lease of a batch being collected (processors/leases.py).
        self.leases = leases
        self.client = client
        # An attempt stage whose worker id is the batch's lease owner: every write of a
        # settled attempt (side-effect log, step output, outcome) is fenced as the batch's.
        self.settler = settler
        self.book = book
        self.settings = settings
        self.worker_id = worker_id
        # The fleet's view of this provider and model (calmq.calls.gate): a refused key
        # blocks it, and a blocked provider gets no batch until a probe call succeeds.
        self.gate = gate
        self._gate = asyncio.Semaphore(4)
        self._outcomes: GroupCommitter[Finish] = GroupCommitter("batch-settle", self._finish,
                                                  retry=RECONNECT, refused=refused)

    async def _finish(self, finishes: list[Finish]) -> None:
        count_accepted((await self.store.attempts.finish(finishes)).accepted)

    async def pass_once(self) -> int:
        """Look at the batches due; returns how many were taken."""
        s = self.settings
        due = await self.store.batches.claim_due(self.worker_id, s.batch_lease_seconds,
                                                 pool=s.pool)
        await asyncio.gather(*(self._one(b) for b in due))
        return len(due)

    async def _one(self, batch: OpenBatch) -> None:
        async with self._gate:
            try:
                try:
                    await self._follow(batch)
                except (BatchRefused, ProviderBlocked) as exc:
                    await self._refused(batch, exc)
            except Exception:  # the lease lapses and the next pass retries it
                log.exception("following batch %s failed", batch.key)

    async def _follow(self, batch: OpenBatch) -> None:
        s = self.settings
        if batch.ended:
            await self._delete(batch)
            return
        if batch.state == "creating":
            await self._create_or_adopt(batch)
            return
        assert batch.provider_id is not None
        view = await self.client.view(batch.provider_id)
        cancel = batch.cancel_requested or not await self.store.batches.pending_jobs(
            batch.key, None, 1)
        if cancel and not view.ended:
            # Asked to, or none of its jobs waits for it any more (each was cancelled or
            # deleted): the provider need not run (nor bill) the rest.
            await self.client.cancel(batch.provider_id)
            view = await self.client.view(batch.provider_id)
        if not view.ended:
            poll = 1.0 if cancel else s.batch_poll_interval_seconds
            await self.store.batches.release(batch.key, self.worker_id, status=view.status,
                                             counts=view.counts, poll_seconds=poll)
            return
        await self._collect(batch, view)
        await self._delete(batch, view)

    async def _delete(self, batch: OpenBatch, view: BatchView | None = None) -> None:
        """Delete what the provider keeps of an ended batch (its input and result files, or
        the batch and its results): nothing of a job stays with the provider once calmq has
        its result, nor once the job is deleted."""
        assert batch.provider_id is not None
        try:
            # Within the try: a batch the provider no longer knows (404) has nothing left.
            await self.client.delete(view or await self.client.view(batch.provider_id))
        except BatchRefused as exc:
            if spec(exc.failure.code, exc.failure.failure_class).pauses:
                raise
            if not exc.missing:  # a 404: the provider has none of it (expired, deleted)
                # A server without deletion (some OpenAI-compatible ones): nothing to retry.
                log.warning("the provider refused to delete batch %s's files; they stay "
                            "there: %s", batch.provider_id, exc.message)
        await self.store.batches.files_deleted(batch.key)
        DELETED.inc()

    async def _refused(self, batch: OpenBatch, exc: BatchRefused | ProviderBlocked) -> None:
        """The provider refused a call for this batch. A refused key, permission, model or
        billing blocks the provider and model fleet-wide, as online: the jobs of a batch not
        yet created wait queued (uncounted) until the block lifts; a batch at the provider
        waits for its next poll. A create refused for a request's content fails that
        request only; the batch's other jobs go to another batch, uncounted."""
        failure = exc if isinstance(exc, ProviderBlocked) else exc.failure
        pauses = isinstance(exc, ProviderBlocked) or spec(failure.code,
                                                          failure.failure_class).pauses
        if pauses and isinstance(exc, BatchRefused) and self.gate is not None:
            failure = await self.gate.failed(failure)
            # Unconfirmed by the gate's probe (calmq.calls.gate): the refusal was about this
            # batch's content, not the key, so no job waits for a block that never comes.
            pauses = isinstance(failure, ProviderBlocked)
        if (batch.state == "submitted" and isinstance(exc, BatchRefused) and exc.missing
                and batch.provider_id is not None):
            # The provider has no such batch (any more): its jobs were not run there, and go
            # to another batch (batch_result_missing, retried).
            log.error("batch %s (%s) is gone from the provider", batch.provider_id, batch.key)
            await self._collect(batch, BatchView(batch.provider_id, "missing", "missing"))
            await self.store.batches.files_deleted(batch.key)
            return
        if batch.state != "creating":
            log.warning("batch %s: the provider refused a call: %s", batch.key,
                        failure.message[:300])
            await self.store.batches.later(batch.key, self.worker_id, self._poll())
            return
        if pauses:
            back = await self.store.batches.hand_back(
                batch.key, None, waiting_reason="provider_blocked", republish_jobs=False,
                detail={"reason": "provider_blocked", "code": failure.code,
                        "provider": self.client.kind, "model": self.client.model})
            await self.store.batches.abandon(batch.key)
            log.error("batch %s not created, its provider is blocked (%s): %d jobs wait for "
                      "it", batch.key, failure.code, len(back))
            return
        requests = await self.store.batches.requests(batch.key)
        named = _request_index(failure.message)
        culprit = requests[named][0] if named is not None and named < len(requests) else None
        await self._fail_whole(batch, BatchView("", "refused", "failed"), failure.message,
                               {culprit: failure.message} if culprit else {})
        await self.store.batches.abandon(batch.key)

    def _poll(self) -> float:
        return self.settings.batch_poll_interval_seconds

    async def _create_or_adopt(self, batch: OpenBatch) -> None:
        """A batch whose batcher died between recording it and recording the provider's id:
        found at the provider by its key and adopted, or created now (exactly once)."""
        s = self.settings
        known = await self.store.batches.known_ids(self.client.kind)
        found = await self.client.find(str(batch.key), batch.created_at, batch.request_count,
                                       known)
        if found is not None:
            view = await self.client.view(found)
            ADOPTED.inc()
            log.warning("adopted batch %s (%s), created before its batcher stopped", found,
                        batch.key)
        else:
            if self.gate is not None:
                # Only once the provider is known not to have it: a batch it has is adopted
                # whatever the gate says. Blocked: its jobs wait uncounted (_refused).
                await self.gate.admit()
            requests = await self.store.batches.requests(batch.key)
            if not requests:
                await self.store.batches.collected(batch.key, None, {})
                return
            view = await self.client.create([self.client.line(c, r) for c, r in requests],
                                            str(batch.key))
            CREATED.labels(self.client.kind).inc()
        await self.store.batches.submitted(batch.key, view.provider_id, view.status,
                                           s.batch_poll_interval_seconds)

    async def _collect(self, batch: OpenBatch, view: BatchView) -> None:
        started = time.monotonic()
        runner = self.settler(batch_owner(batch.key))
        counts: dict[str, int] = {}
        # The lease is kept while the results stream in (a 200 MB file, a 50 MB line): no
        # other poller takes the batch meanwhile.
        with self.leases.keeping_batch(batch.key):
            if view.outcome == "failed":
                await self._failed(batch, view, runner, counts)
            else:
                await self._results(batch, view, runner, counts)
            await self._unanswered(batch, view, runner, counts)
        await self.store.batches.collected(batch.key, view.status, {**view.counts, **counts})
        TURNAROUND.observe(max(0.0, (datetime.now(UTC) - batch.created_at).total_seconds()))
        log.info("batch %s collected in %.1f s: %s", view.provider_id,
                 time.monotonic() - started, counts)

    async def _results(self, batch: OpenBatch, view: BatchView, runner: Attempt,
                       counts: dict[str, int]) -> None:
        chunk: list[BatchResult] = []
        async for result in self.client.results(view):
            if not result.custom_id:
                # A line that names no request: its request (if any) ends unanswered.
                counts["unreadable_lines"] = counts.get("unreadable_lines", 0) + 1
                UNREADABLE.inc()
                continue
            chunk.append(result)
            if len(chunk) >= _SETTLE_CHUNK:
                await self._settle(runner, batch, chunk, counts)
                chunk = []
        await self._settle(runner, batch, chunk, counts)

    async def _unanswered(self, batch: OpenBatch, view: BatchView, runner: Attempt,
                          counts: dict[str, int]) -> None:
        """Requests the results do not answer: not run (the batch expired, was cancelled, or
        failed as a whole), or missing."""
        missing = {"expired": "batch_expired", "cancelled": "batch_cancelled",
                   "failed": "batch_failed"}.get(view.outcome or "", "batch_result_missing")
        why = "; ".join(e.message for e in view.errors)[:500]
        while True:
            rest = await self.store.batches.pending_jobs(batch.key, None, _SETTLE_CHUNK)
            if not rest:
                break
            await self._settle(runner, batch, [BatchResult(c, failure=failure(
                missing, f"the provider did not run this request: {missing}"
                + (f" ({why})" if why else ""))) for c in rest], counts, rest)

    async def _failed(self, batch: OpenBatch, view: BatchView, runner: Attempt,
                      counts: dict[str, int]) -> None:
        """The provider failed the batch as a whole (OpenAI: its input file failed
        validation). The requests its errors name fail as the online call would have; every
        other job goes to another batch with no attempt counted: no tenant's request fails
        another's job. Errors that name no line fail every job (``batch_failed``, retried)."""
        lines = {e.line: e.message for e in view.errors if e.line is not None}
        named = await self.client.input_custom_ids(view, set(lines)) if lines else {}
        culprits = {cid: lines[line] for line, cid in named.items() if cid}
        why = "; ".join(e.message for e in view.errors)[:500] or view.status
        await self._fail_whole(batch, view, why, culprits, runner=runner, counts=counts)

    async def _fail_whole(self, batch: OpenBatch, view: BatchView, why: str,
                          culprits: dict[str, str], *, runner: Attempt | None = None,
                          counts: dict[str, int] | None = None) -> None:
        """A batch refused or failed as a whole: ``culprits`` (custom_id -> the provider's
        message) fail as that request's own 400; when there are some, the other jobs are
        handed back uncounted and re-published for another batch; when there are none, every
        job fails ``batch_failed`` (transient: retried in another batch)."""
        runner = runner or self.settler(batch_owner(batch.key))
        counts = counts if counts is not None else {}
        if not culprits:
            await self._unanswered(batch, BatchView(view.provider_id, view.status, "failed",
                                                    errors=(LineError(why),)), runner, counts)
            return
        pending = await self.store.batches.pending_jobs(batch.key, list(culprits))
        await self._settle(runner, batch, [BatchResult(c, failure=classify_status(
            400, culprits[c], None)) for c in pending], counts, pending)
        back = await self.store.batches.hand_back(
            batch.key, None, waiting_reason=None, republish_jobs=True,
            detail={"reason": "batch_failed", "batch_id": view.provider_id,
                    "message": why[:300]})
        counts["handed_back"] = counts.get("handed_back", 0) + len(back)
        log.warning("batch %s failed as a whole (%s): %d request(s) named, %d job(s) sent to "
                    "another batch uncounted", batch.key, why[:200], len(pending), len(back))

    async def _settle(self, runner: Attempt, batch: OpenBatch, results: list[BatchResult],
                      counts: dict[str, int], jobs: dict[str, Job] | None = None) -> None:
        if not results:
            return
        if jobs is None:
            jobs = await self.store.batches.pending_jobs(batch.key,
                                                         [r.custom_id for r in results])
        by_id = {r.custom_id: r for r in results}
        window = (self.settings.batch_completion_window_seconds
                  + self.settings.batch_deadline_margin_seconds)
        online: list[uuid.UUID] = []
        work: list[tuple[Job, str]] = []
        batch_topic = topics.topic_for_route(topics.batch_route(batch.pool))
        for cid, job in jobs.items():
            result = by_id[cid]
            self.book.results[str(job.id)] = result
            topic = batch_topic
            if (result.failure is not None and result.failure.retryable
                    and job.deadline_at is not None
                    and (job.deadline_at - datetime.now(UTC)).total_seconds() < window):
                # Another batch would miss the deadline: the retry goes online.
                topic = topics.topic_for_route(topics.work_route(job.pool, "bulk", ONLINE))
                online.append(job.id)
            work.append((job, topic))
        ends = await asyncio.gather(*(self._attempt(runner, job, topic)
                                      for job, topic in work))
        blocked = [job for (job, _t), end in zip(work, ends, strict=True)
                   if isinstance(end, ProviderBlocked)]
        if blocked:
            # Refused for the key, per request: the provider and model are blocked; these
            # jobs wait uncounted, as an online attempt that met the block would.
            code = next(e.code for e in ends if isinstance(e, ProviderBlocked))
            await self.store.batches.hand_back(
                batch.key, [j.id for j in blocked], waiting_reason="provider_blocked",
                republish_jobs=False,
                detail={"reason": "provider_blocked", "code": code,
                        "provider": self.client.kind, "model": self.client.model,
                        # their own results met it: one such hand-back each (attempt.py)
                        "met": True})
            counts["provider_blocked"] = counts.get("provider_blocked", 0) + len(blocked)
        work = [(job, t) for (job, t), end in zip(work, ends, strict=True)
                if isinstance(end, Finish)]
        finishes = [end for end in ends if isinstance(end, Finish)]
        await self.store.batches.fall_back_online(
            [i for i in online if i not in {j.id for j in blocked}])
        # Written like the worker's committer: again while the database is away, and split
        # (never retried forever) when one outcome's data is refused.
        refusals = await self._outcomes.write_group(finishes) or []
        for finish, error in zip(finishes, refusals, strict=False):
            if error is not None:
                log.error("batch outcome of %s dropped: %s", finish.job_id, error)
        rows = []
        for (job, _), finish in zip(work, finishes, strict=True):
            tokens_in, tokens_out, cost, online_cost = self.book.costs.pop(
                str(job.id), (0, 0, 0.0, 0.0))
            self.book.results.pop(str(job.id), None)
            state = "retried" if finish.status == "retrying" else "settled"
            label = "succeeded" if finish.error is None else str(finish.error.get("code"))
            counts[label] = counts.get(label, 0) + 1
            SETTLED.labels("ok" if finish.error is None else "failed").inc()
            who = (str(job.tenant_id), batch.model)
            COST.labels(*who).inc(cost)
            ONLINE_COST.labels(*who).inc(online_cost)
            SAVINGS.labels(*who).inc(max(0.0, online_cost - cost))
            rows.append({"custom_id": custom_id(job.id, job.attempt), "state": state,
                         "input_tokens": tokens_in, "output_tokens": tokens_out,
                         "cost_usd": cost, "online_cost_usd": online_cost})
        for job in blocked:
            self.book.results.pop(str(job.id), None)
        # Results of jobs no longer held (cancelled meanwhile) are ignored; their rows end
        # ``cancelled`` when the batch is collected.
        await self.store.batches.settle(batch.key, rows)

    @staticmethod
    async def _attempt(runner: Attempt, job: Job, topic: str) -> Finish | ProviderBlocked:
        """The attempt of ``job`` answered from its result (own task: own scope); a result
        refused for the key ends in ``ProviderBlocked`` (the job is handed back)."""
        async def run() -> Finish | ProviderBlocked:
            clock = model_clock()
            try:
                finish = await runner.run(job, topic)
            except ProviderBlocked as blocked:
                return blocked
            finish.usage = {"model_calls": clock.calls, "input_tokens": clock.input_tokens,
                            "output_tokens": clock.output_tokens, "cost_usd": clock.cost_usd,
                            "model": clock.model,
                            "cached_input_tokens": clock.cached_input_tokens,
                            "cache_write_tokens": clock.cache_write_tokens,
                            "cache_saved_usd": clock.cache_saved_usd}
            for entry in finish.outbox:
                if entry.type in ("job.result", "job.dead_lettered"):
                    # the lane the usage was spent in (finish_attempts fills the totals)
                    entry.payload["usage"] = {"input_tokens": 0, "output_tokens": 0,
                                              "cost_usd": 0.0, "lane": "batch"}
            return finish

        return await asyncio.create_task(run())


def _request_index(message: str) -> int | None:
    """The request a batch create's refusal names (Anthropic: ``requests.3.params...``)."""
    found = re.search(r"\brequests\.(\d+)\b", message)
    return int(found.group(1)) if found else None


# -- the process --------------------------------------------------------------------------

class BatchLane:
    """`calmq batcher`: the batcher and the poller of one pool in one process (a ``Service``
    of calmq.supervision, run until SIGTERM like a worker)."""

    name = "batcher"

    def __init__(self, settings: Settings, workflows: dict[str, Workflow] | None = None, *,
                 pack: bool = True, poll: bool = True) -> None:
        self.settings = settings
        self.workflows = workflows or load_workflows(settings)
        self.worker_id = settings.worker_id or f"batcher-{socket.gethostname()}-{os.getpid()}"
        self.pack = pack
        self.poll = poll
        self.life = Lifecycle(self, grace_seconds=settings.grace_seconds)
        self._store: Store | None = None
        self._packer: BatchPacker | None = None
        self._book: ReplyBook | None = None
        self._gate: ProviderGate | None = None
        self._pipeline: Pipeline | None = None
        self._consuming: asyncio.Task[None] | None = None
        self._packing: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._drained = threading.Event()

    def topic(self) -> str:
        return topics.topic_for_route(topics.batch_route(self.settings.pool))

    def _client(self) -> BatchClient:
        s = self.settings
        return open_batch_client(s.provider, s.effective_provider_url,
                                 s.provider_api_key.get_secret_value(), s.model,
                                 max_line=s.batch_max_result_line_bytes)

    async def _provider_gate(self, store: Store, client: BatchClient) -> ProviderGate:
        """The provider and model's fleet-wide gate, shared with the workers (the same key:
        kind and URL): a key refused in the batch lane blocks them online too, and the other
        way round; a probe call every provider_probe_seconds lifts it and releases the
        jobs that wait for it."""
        s = self.settings
        return await open_gate(store, s.provider, s.effective_provider_url,
                               s.provider_api_key.get_secret_value(), s.model,
                               probe=client.probe, probe_seconds=s.provider_probe_seconds)

    async def run(self) -> None:
        await self.life.run()

    async def start(self, life: Lifecycle) -> None:
        s = self.settings
        loop = asyncio.get_running_loop()
        connection = await asyncio.to_thread(service_connection, s)
        store = self._store = Store(s.database_url, max_size=8, keep_errors=s.max_job_errors,
                                    **Store.pool_options(s))
        await store.open()
        codec = make_codec(s.schema_registry_url, registry_config(s),
                           s.name_prefix)
        objects = open_object_store(s.object_store_url)
        packer = self._packer = BatchPacker(self._client(), s, store, self.worker_id)
        window = packer.max_requests
        consumer = ParallelConsumer(
            consumer_config(connection, topics.batcher_group(s.pool)), [self.topic()],
            deliver=lambda batch: loop.call_soon_threadsafe(pipeline.submit, batch),
            max_in_flight=window, commit_interval=s.commit_interval_ms / 1000,
            interactive_reserve=0, settling=lambda: pipeline.committer.pending)
        poison = PoisonSink(Producer(producer_config(connection,
                                                     compression=s.kafka_compression)), codec)
        failures = failure_stage(s, self.worker_id, self.workflows)
        # Spend caps hold on this lane as online: a capped tenant's jobs wait in queued
        # before they are packed (half price is still spend), and the fleet-wide release
        # pass re-publishes them to this lane once no cap holds them.
        ledger = SpendLedger(store)
        spend = spend_caps_from_settings(s, ledger)
        packer.spend = spend
        # The holds whose rule is SQL alone (calmq.holds) hold here as online.
        gates: list[Gate] = [SpendCapGate(spend, ledger), *statement_gates(store),
                             ReviewCapGate(store, review_workflows(self.workflows))]
        # A workflow's concurrency_limit holds on this lane as online: a key's jobs beyond
        # it wait (concurrency_key) before they are packed, and a packed job counts as
        # running until its result settles, so a pack takes no more of a key's jobs than
        # the limit leaves room for. The fleet's release pass (every worker and `calmq
        # reaper` that load the workflow) re-publishes them to this lane as those settle.
        limits = concurrency_limits(self.workflows)
        if limits:
            gates.append(ConcurrencyKeyGate(ConcurrencyKeys(store), limits, s.lease_seconds,
                                            waiting_max=s.concurrency_keys_waiting_max))
        # A packed attempt waits for its batch to be recorded: its step timeout is the
        # provider's window, and a pack's worth of them wait at once.
        pipeline = self._pipeline = Pipeline(
            store=store, tracker=consumer.tracker,
            intake=Intake(codec, poison, consumer.tracker),
            gates=gates,
            attempt=Attempt(store=store, provider=packer, objects=objects,
                            workflows=self.workflows, failures=failures,
                            worker_id=self.worker_id, slots=CallSlots(window),
                            step_timeout_seconds=s.batch_completion_window_seconds,
                            review_deadline_seconds=s.review_deadline_seconds,
                            key_rate_limits=False),
            worker_id=self.worker_id, lease_seconds=s.lease_seconds, workflows=self.workflows)
        packer.pipeline = pipeline
        book_client = self._client()
        gate = self._gate = await self._provider_gate(store, book_client)
        packer.gate = gate
        book = self._book = ReplyBook(book_client, s, gate)

        def settler(owner: str) -> Attempt:
            return Attempt(store=store, provider=book, objects=objects,
                           workflows=self.workflows,
                           failures=failure_stage(s, owner, self.workflows), worker_id=owner,
                           step_timeout_seconds=s.step_timeout_seconds or 60.0,
                           review_deadline_seconds=s.review_deadline_seconds,
                           key_rate_limits=False)

        poller = Poller(store=store, client=book.client, settler=settler, book=book,
                        settings=s, worker_id=self.worker_id, leases=pipeline.leases,
                        gate=gate)
        pipeline.start()
        if self.pack:
            self._consuming = life.side.spawn(
                "kafka-consumer", lambda: asyncio.to_thread(consumer.run, life.stop,
                                                            self._drained.is_set),
                critical=True)
            self._packing = life.side.spawn("batch-packer", lambda: packer.run(self._stopping),
                                            critical=True)
        pipeline.leases.schedule(life.side, batch_lease_seconds=s.batch_lease_seconds)
        if self.pack:
            schedule_spend_release(life.side, spend, first_after=spend.refresh_seconds)
        if self.poll:
            life.side.every("batch-poller", min(1.0, s.batch_poll_interval_seconds),
                            poller.pass_once)

        async def gauges() -> None:
            stats = await store.batches.stats()
            OPEN_BATCHES.set(stats.get("open_batches", 0))
            OLDEST_BATCH.set(stats.get("oldest_seconds", 0.0))
            for state in ("pending", "settled", "retried", "cancelled"):
                BATCH_JOBS.labels(state).set((stats.get("jobs_by_state") or {}).get(state, 0))
            RESERVED.set(stats.get("reserved_usd", 0.0))

        life.side.every("batch-gauges", 5.0, gauges)
        log.info("batcher %s: %s, provider %s, model %s", self.worker_id, self.topic(),
                 s.provider, s.model)

    async def tick(self) -> None:
        return None

    async def drain(self, grace_seconds: float) -> None:
        # What the packer holds goes into batches now; then the stages drain exactly as a
        # worker's do (processors/pipeline.py).
        self._stopping.set()
        if self._packer is not None:
            await self._packer.flush_all()
        if self._packing is not None:
            await asyncio.wait([self._packing], timeout=30)
        if self._pipeline is not None:
            await self._pipeline.drain(grace_seconds)
        await self._stop_consuming()

    async def _stop_consuming(self) -> None:
        self._drained.set()
        if self._consuming is not None:
            await asyncio.wait([self._consuming], timeout=30)

    async def close(self) -> None:
        self._stopping.set()
        await self._stop_consuming()
        if self._packer is not None:
            await self._packer.close()
        if self._gate is not None:
            await self._gate.close()
        if self._book is not None:
            await self._book.client.close()
        if self._store is not None:
            await self._store.close()
