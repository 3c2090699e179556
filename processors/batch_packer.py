"""The batch lane's packer: a batch-lane attempt's model call becomes a request in a
provider batch (processors/batcher.py composes it).

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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from calmq.calls import ProviderGate, estimate_prompt_tokens
from calmq.calls.batch_apis import BatchClient, BatchRefused, custom_id
from calmq.calls.pricing import batch_cost_usd
from calmq.calls.wires import ModelReply
from calmq.data import Job, Store
from calmq.data.batches import BatchRequestRow
from calmq.data.spending import Charge
from calmq.errors import FailureClass, InfrastructureError, StepFailure
from calmq.failure_codes import spec
from calmq.processors import metrics
from calmq.processors.batch_metrics import CREATED, PACKED, SPEND_HELD
from calmq.processors.pipeline import Pipeline
from calmq.retrying import retry_forever
from calmq.settings import Settings
from calmq.spending import SpendCaps

__all__ = ["BatchPacker"]

log = logging.getLogger(__name__)


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
        recorded = await self._record(pack)
        if recorded is None:
            return
        key, items, moved, refused = recorded
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
        await self._create(key, [i.line for i in items if i.job.id in moved], len(moved))

    async def _record(self, pack: _Pack) -> tuple[uuid.UUID, list[_Waiting], set[uuid.UUID],
                                                  dict[uuid.UUID, str]] | None:
        """The pack recorded as a batch under a new key, its jobs moved to the batch's lease
        and its requests' cost reserved, in one transaction: the key, the pack's requests,
        the jobs moved and those a spend cap held (None: not recorded, the pack is put
        back)."""
        s = self.settings
        try:
            if not await self._room(pack):
                log.info("the provider's batch queue for %s is full (%d tokens): %d jobs wait",
                         pack.model, s.batch_enqueued_tokens_limit, len(pack.items))
                self._put_back(pack)
                return None
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
            return None
        return key, items, moved, refused

    async def _create(self, key: uuid.UUID, lines: list[bytes], count: int) -> None:
        """The recorded batch ``key`` created at the provider with its ``count`` requests'
        ``lines``, and its provider id recorded."""
        s = self.settings
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
        log.info("batch %s (%s) created with %d requests", view.provider_id, key, count)

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

