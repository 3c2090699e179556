"""The batch lane's poller: follows each provider batch until its results are settled
(processors/batcher.py composes it).

One poller at a time holds a batch (a lease on its row). A batch still ``creating``
whose batcher died is found again at the provider by its key (adopted) or created then;
never twice. A batch that ended is collected: its results are streamed in chunks and each
job is settled by the worker's own attempt stage (processors/attempt.py), with a provider
that answers from the result (``ReplyBook``): the same step function validates the output,
the same progress code writes the artifact or asks for a review, the same failure stage
picks retry or dead letter, and the same group commit writes status, history and outbox in
one transaction. A request that failed transiently goes back to the batch topic (via a retry
tier) for a later batch; one the provider did not run (batch expired or cancelled) too,
unless its deadline would then be missed: that job continues online.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from calmq import topics
from calmq.calls import ProviderGate
from calmq.calls.batch_apis import (
    BatchClient,
    BatchRefused,
    BatchResult,
    BatchView,
    LineError,
    custom_id,
)
from calmq.calls.pricing import batch_cost_usd, cost_usd
from calmq.calls.wires import ModelReply, classify_status, current_clock, model_clock
from calmq.data import Finish, Job, Store
from calmq.data.batches import OpenBatch, batch_owner
from calmq.errors import FailureClass, StepFailure
from calmq.failure_codes import ProviderBlocked, failure, spec
from calmq.group_commit import GroupCommitter
from calmq.job_costs import count_accepted
from calmq.lanes import ONLINE
from calmq.processors.attempt import Attempt
from calmq.processors.batch_metrics import (
    ADOPTED,
    COST,
    CREATED,
    DELETED,
    ONLINE_COST,
    SAVINGS,
    SETTLED,
    TURNAROUND,
    UNREADABLE,
)
from calmq.processors.leases import Leases
from calmq.retrying import RECONNECT
from calmq.settings import Settings
from calmq.storable import refused

__all__ = ["Poller", "ReplyBook"]

log = logging.getLogger(__name__)

_SETTLE_CHUNK = 200


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
        work, online = self._route(batch, results, jobs)
        ends = await asyncio.gather(*(self._attempt(runner, job, topic)
                                      for job, topic in work))
        blocked = [job for (job, _t), end in zip(work, ends, strict=True)
                   if isinstance(end, ProviderBlocked)]
        if blocked:
            code = next(e.code for e in ends if isinstance(e, ProviderBlocked))
            await self._hand_back_blocked(batch, blocked, code, counts)
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
            rows.append(self._settled(batch, job, finish, counts))
        for job in blocked:
            self.book.results.pop(str(job.id), None)
        # Results of jobs no longer held (cancelled meanwhile) are ignored; their rows end
        # ``cancelled`` when the batch is collected.
        await self.store.batches.settle(batch.key, rows)

    def _route(self, batch: OpenBatch, results: list[BatchResult], jobs: dict[str, Job]
               ) -> tuple[list[tuple[Job, str]], list[uuid.UUID]]:
        """Each held job with the topic its attempt retries on (the batch topic, or online
        when another batch would miss its deadline), its result booked for the attempt's
        model call; and the jobs whose retry goes online."""
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
        return work, online

    async def _hand_back_blocked(self, batch: OpenBatch, blocked: list[Job], code: str,
                                 counts: dict[str, int]) -> None:
        """Refused for the key, per request: the provider and model are blocked; these jobs
        wait uncounted, as an online attempt that met the block would."""
        await self.store.batches.hand_back(
            batch.key, [j.id for j in blocked], waiting_reason="provider_blocked",
            republish_jobs=False,
            detail={"reason": "provider_blocked", "code": code,
                    "provider": self.client.kind, "model": self.client.model,
                    # their own results met it: one such hand-back each (attempt.py)
                    "met": True})
        counts["provider_blocked"] = counts.get("provider_blocked", 0) + len(blocked)

    def _settled(self, batch: OpenBatch, job: Job, finish: Finish, counts: dict[str, int]
                 ) -> dict[str, Any]:
        """The settled request's row (its tokens and cost, at the batch price and online),
        counted and metered."""
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
        return {"custom_id": custom_id(job.id, job.attempt), "state": state,
                "input_tokens": tokens_in, "output_tokens": tokens_out,
                "cost_usd": cost, "online_cost_usd": online_cost}

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
