"""Attempt: one claimed job's current step, run once, to one outcome (a ``Finish``).

The step gets its input (inline, or read by reference under the workflow's rules), a call
slot (claimed jobs may wait here; the step's timeout starts after), and its timeout; its
output is checked against the step's model and recorded with the job's next move in the
outcome's transaction (calmq/workflows/progress.py). A step whose output is recorded
already (a redelivery, a replay) is not run again. What went wrong is classified here
(``StepFailure``) and the failure stage picks retry or dead letter:

- the step's own failure or a contract error of its input: as the step says;
- the database, Kafka or the object store away while the step read or recorded something:
  ``infrastructure_error`` / ``artifact_write_failed``, transient (not the job's fault);
- anything else the step raised: ``unhandled_exception``, class ``bug``.

Every write of the attempt carries its fencing token (``job.lease_version``); a write the
database refuses raises ``LeaseLost``, which ends the attempt with no outcome (the caller
acknowledges). Used by the worker and the batch lane alike (its batcher packs the step's
model call, its poller settles the attempt from the batch's result). Imports no consumer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import Any

import psycopg

from calmq.calls import OutputWriter
from calmq.calls.stack import attempt_provider
from calmq.calls.wires import Provider, enter_scope
from calmq.data import Finish, Job, Store
from calmq.data.providers import ProviderLedger
from calmq.data.rate_keys import RateKeys
from calmq.data.steps import SideEffects
from calmq.errors import ContractError, FailureClass, InfrastructureError, LeaseLost, StepFailure
from calmq.failure_codes import ProviderBlocked, WaitUncounted
from calmq.objects import ObjectStore, read_bounded
from calmq.processors import metrics
from calmq.processors.failures import FailureStage
from calmq.processors.slots import CallSlots
from calmq.storable import UNSTORABLE_OUTPUT, clean, unstorable_outcome
from calmq.workflows import StepContext, StepOutput, Workflow
from calmq.workflows.progress import ChildLimits, Progress

__all__ = ["Attempt"]

log = logging.getLogger(__name__)


class Attempt:
    def __init__(self, *, store: Store, provider: Provider, objects: ObjectStore,
                 workflows: Mapping[str, Workflow], failures: FailureStage, worker_id: str,
                 slots: CallSlots | None = None, step_timeout_seconds: float | None = None,
                 review_deadline_seconds: float = 48 * 3600.0,
                 outputs: OutputWriter | None = None,
                 step_providers: Mapping[tuple[str, str], Provider] | None = None,
                 key_rate_limits: bool = True,
                 child_limits: ChildLimits | None = None) -> None:
        self.store = store
        self.provider = provider
        # The steps that name their allowed models (calmq.calls.fallback), by (workflow, step);
        # every other step calls the worker's model.
        self.step_providers = dict(step_providers or {})
        # None: workflows' key rate limits do not apply (the batch lane: its requests go to
        # the provider's batch API, limited and billed as a batch, hours later).
        self.rate_keys = RateKeys(store) if key_rate_limits else None
        self.objects = objects
        self.workflows = workflows
        self.failures = failures
        self.worker_id = worker_id
        self.slots = slots  # None: no bound (the batch lane's settling)
        self.step_timeout_seconds = step_timeout_seconds  # overrides every step's own
        # Where streamed steps' text goes as the model writes it (None: nowhere, the batch
        # lane: its calls are answered whole).
        self.outputs = outputs
        self.progress = Progress(store, objects, review_deadline_seconds,
                                 workflows=workflows, limits=child_limits)

    async def run(self, job: Job, topic: str) -> Finish:
        """The outcome of ``job``'s attempt, as it will be committed (by the committer or
        the batch poller), held to what PostgreSQL can store first; ``topic``: where its
        message came from (a retry goes back there). Raises only ``LeaseLost`` and
        cancellation."""
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
            output = await self._step(job, workflow)
        except ProviderBlocked as blocked:
            if blocked.met and await self._met_block_before(job):
                # Its own call met a blocked provider's refusal again, after its one
                # uncounted wait for the block to lift: counted now, it ends in dead letter
                # with the code instead of being sent again at every unblock.
                return self.failures.outcome(job, topic, StepFailure(
                    f"{blocked.message} (met again after one uncounted wait for the block "
                    f"to lift)", code=blocked.code, failure_class=blocked.failure_class))
            raise  # not the job's attempt: the pipeline hands the job back, uncounted
        except WaitUncounted:
            raise  # not the job's attempt: the pipeline hands the job back, uncounted
        except StepFailure as failure:
            return self.failures.outcome(job, topic, failure)
        except ContractError as exc:
            return self.failures.outcome(job, topic, StepFailure(
                exc.message, code=exc.code, failure_class=FailureClass.INPUT))
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
            return self.failures.outcome(job, topic, StepFailure(
                f"{type(exc).__name__}: {exc}", code="unhandled_exception",
                failure_class=FailureClass.BUG))
        finally:
            metrics.STEP_SECONDS.observe(time.monotonic() - started)
        assert workflow is not None
        try:
            # Record the output with the job and move it on (next step, review or
            # completed) in the same transaction.
            return await self.progress.succeeded(job, workflow, output, self.worker_id)
        except (asyncio.CancelledError, LeaseLost):
            raise
        except Exception as exc:  # noqa: BLE001 - every attempt ends in one outcome
            # After the model call: writing the artifact or step output failed. The store
            # being away is not the job's fault (retried); anything else is a bug.
            return self.failures.outcome(job, topic, _after_step(job, exc))

    async def _met_block_before(self, job: Job) -> bool:
        """Whether ``job`` was handed back once already after its own call met a blocked
        provider (calmq.failure_codes.ProviderBlocked.met); the database away: not known,
        so handed back (the hand-back waits for the database)."""
        try:
            return await ProviderLedger(self.store).met_before(job.id)
        except (psycopg.Error, InfrastructureError, OSError) as exc:
            log.warning("reading the hand-backs of %s failed: %s", job.id, exc)
            return False

    async def _step(self, job: Job, workflow: Workflow) -> StepOutput:
        step = workflow.step(job.step)
        deadline = job.deadline_at
        if deadline is not None and deadline < datetime.now(UTC):
            raise StepFailure("the job deadline passed before it could run",
                              code="deadline_exceeded", failure_class=FailureClass.DEADLINE)
        # A step whose output is recorded already is not run again (redelivery, replay).
        recorded = await self.progress.recorded(job, workflow)
        replayed = self.progress.replay(step, recorded)
        if replayed is not None:
            return replayed
        data = self.progress.step_input(workflow, step, recorded)
        if data is None:
            data = await self._input(job, workflow)
        else:  # after a step that started children: their outcomes, in input order
            data = await self.progress.joined(job, data)
        if log.isEnabledFor(logging.DEBUG):  # the formatter redacts "input" fields
            log.debug("step %s starts", step.name, extra={"input": data})
        # The effect log of this attempt: its records carry the fencing token.
        effects = SideEffects(self.store, self.worker_id, job.lease_version)
        # The attempt's own output stream (named by its fencing token): a streamed call's
        # text reaches the job's followers as the model writes it.
        streamed = (self.outputs.open(job.id, job.lease_version, step.name, job.attempt)
                    if self.outputs is not None else None)
        # The key's rate limit, fleet-wide (a call past it waits uncounted), and the stream.
        provider = attempt_provider(
            self.step_providers.get((workflow.name, step.name), self.provider), streamed,
            stream_calls=step.streams(job.priority), buckets=self.rate_keys,
            tenant_id=job.tenant_id, key=job.concurrency_key, scope=workflow.name,
            limit=workflow.key_rate_limit)
        ctx = StepContext(str(job.id), str(job.tenant_id), step.name, job.attempt,
                          provider, self.objects, effects, priority=job.priority,
                          workflow=job.workflow, lease_version=job.lease_version,
                          pool=job.pool)
        timeout = self.step_timeout_seconds or step.timeout_seconds
        # Claimed ahead, a job may wait here for a slot; its timeout starts after.
        if self.slots is not None:
            await self.slots.acquire(job.priority)
        # The budget's priority, the meter's labels, and the time the step's calls have
        # (its timeout, or the job's deadline if sooner): their service tier's measure.
        ends = time.time() + timeout
        enter_scope(replace(ctx.call_scope(), deadline=ends if deadline is None
                            else min(ends, deadline.timestamp())))
        try:
            async with asyncio.timeout(timeout):
                output = await step.run(ctx, data)
        except TimeoutError:
            raise StepFailure(f"the step ran past its {timeout:g} s timeout", code="timeout",
                              failure_class=FailureClass.TRANSIENT) from None
        finally:
            if self.slots is not None:
                self.slots.release()
            if streamed is not None:
                # Its chunks are written before the outcome is (and so before the event a
                # follower sees last), whatever the outcome.
                await streamed.close()
        return StepOutput(step.check_output(output.artifact), output.confidence,
                          output.input_tokens, output.output_tokens, output.spawn)

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
