"""Workflows: named, versioned lists of steps. A step is a plain async function.

The business function stays testable alone: it receives a ``StepContext`` (the model
gateway, the job's identity, an idempotency key, and optionally the object store and the
side-effect log) and its input, and returns its output; it knows nothing of Kafka or the
database. The runner records each step's output with the job before the next step's event
goes out, so a crash resumes at the step that failed (docs/explanation/workflows.md).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pydantic import BaseModel, ValidationError

from calmq.calls.wires import CallScope, Provider
from calmq.errors import ContractError, FailureClass, StepFailure
from calmq.jobs import Priority
from calmq.storable import non_finite

if TYPE_CHECKING:
    from calmq.data.steps import EffectRecord
    from calmq.objects import ObjectStore
    from calmq.settings import Settings

__all__ = [
    "ByReference",
    "EffectLog",
    "JoinPolicy",
    "KeyRateLimit",
    "RetryPolicy",
    "ReviewExpiry",
    "Spawn",
    "Step",
    "StepContext",
    "StepFunction",
    "StepOutput",
    "Workflow",
    "any_timed_wait",
    "builtin_workflows",
    "find_workflow",
    "load_workflows",
]


class EffectLog(Protocol):
    """Where "record then call then confirm" (calmq.workflows.effects) keeps its records:
    calmq.data.steps.SideEffects in PostgreSQL, MemoryEffectLog for a step tested alone."""

    async def lookup(self, job_id: str, key: str) -> EffectRecord | None: ...

    async def called(self, job_id: str, key: str) -> int: ...

    async def confirmed(self, job_id: str, key: str, response: dict[str, Any]) -> None: ...


@dataclass(frozen=True)
class StepContext:
    job_id: str
    tenant_id: str
    step: str
    attempt: int
    provider: Provider
    objects: ObjectStore | None = None
    effects: EffectLog | None = None
    # Which share of the token budget the step's model calls draw on (calmq.calls.budget).
    priority: str = "bulk"
    workflow: str = ""
    # The attempt's fencing token (its claim's lease_version): objects it writes are keyed
    # by it, so a stale attempt never overwrites what the attempt holding the job wrote.
    lease_version: int = 0
    # The pool the step runs on: a step may start its children there (Spawn.pool).
    pool: str = ""

    def spawn(self, workflow: str, inputs: Sequence[dict[str, Any]], *,
              join: JoinPolicy | JoinKind = "all", lane: Literal["online", "batch"] | None = None,
              priority: Literal["interactive", "bulk"] | None = None,
              concurrency_key: str | None = None, output: dict[str, Any] | None = None,
              pool: str | None = None) -> StepOutput:
        """The step's output that starts one child job of ``workflow`` per input: return it.
        The job waits (queued, waiting_reason ``children``) until ``join`` holds; its next
        step then gets ``output`` with the children, in input order (calmq.workflows.Spawn)."""
        return StepOutput(artifact=dict(output or {}), spawn=Spawn(
            workflow, tuple(inputs), join=join if isinstance(join, JoinPolicy)
            else JoinPolicy(join), lane=lane, priority=priority,
            concurrency_key=concurrency_key, pool=pool))

    @property
    def idempotency_key(self) -> str:
        """Stable across attempts of this step: hand it to external systems."""
        return f"{self.job_id}:{self.step}"

    def call_scope(self) -> CallScope:
        """What the gateway needs to know about this step's model calls (budget, metering)."""
        return CallScope(self.job_id, self.tenant_id, self.workflow, self.priority)

    def object_key(self, name: str) -> str:
        """Where this attempt of the step keeps an object of its own: under the tenant's
        prefix, in the job's folder (a purge deletes it whole), by the attempt's fencing
        token (an attempt that lost its lease writes beside the winner's, never over it)."""
        return f"{self.tenant_id}/{self.job_id}/{self.step}/{self.lease_version}/{name}"


JoinKind = Literal["all", "at_least", "all_finish"]


@dataclass(frozen=True)
class JoinPolicy:
    """When a job that started children goes on: ``all`` of them succeed; ``at_least`` ``k``
    of them succeed; ``all_finish``: every one ended, the failed ones listed. A join that can
    no longer hold (a child of ``all`` failed; too many failed for ``k``) fails the job at
    once, naming the failed children."""

    kind: JoinKind = "all"
    k: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in ("all", "at_least", "all_finish"):
            raise ValueError(f"a join is all, at_least or all_finish, not {self.kind!r}")
        if (self.kind == "at_least") != (self.k is not None) or (self.k is not None
                                                                 and self.k < 1):
            raise ValueError("a join at_least k needs k >= 1, and only it takes k")

    def needed(self, n: int) -> int:
        """How many of ``n`` children must succeed (all_finish: none)."""
        if self.kind == "all":
            return n
        if self.kind == "at_least":
            assert self.k is not None
            return self.k
        return 0


@dataclass(frozen=True)
class Spawn:
    """Child jobs a step starts (``StepContext.spawn``): one job of ``workflow`` per input,
    each an ordinary job (its own id, retries, lease) of the parent's tenant, trace and
    deadline; ``lane``, ``priority`` and ``concurrency_key`` default to the parent's lane,
    priority and none, ``pool`` to the child workflow's (``ctx.pool``: where the parent
    runs). They are written with the step's output, in one transaction."""

    workflow: str
    inputs: tuple[dict[str, Any], ...]
    join: JoinPolicy = JoinPolicy()
    lane: Literal["online", "batch"] | None = None
    priority: Literal["interactive", "bulk"] | None = None
    concurrency_key: str | None = None
    pool: str | None = None

    def __post_init__(self) -> None:
        if not self.inputs:
            raise ValueError("a spawn starts at least one child")
        if self.join.k is not None and self.join.k > len(self.inputs):
            raise ValueError(f"a join at least {self.join.k} of {len(self.inputs)} children "
                             "can never hold")


@dataclass(frozen=True)
class StepOutput:
    """What a step produced: the output (the last step's is the artifact), and the model's
    confidence if any (below the workflow's threshold, a person reviews it). ``spawn``:
    child jobs to start; the next step runs once they joined."""

    artifact: dict[str, Any]
    confidence: float | None = None
    input_tokens: int = 0
    output_tokens: int = 0
    spawn: Spawn | None = None


StepFunction = Callable[[StepContext, dict[str, Any]], Awaitable[StepOutput]]


@dataclass(frozen=True)
class RetryPolicy:
    """A step's own retry policy; only ``transient`` failures are ever retried, and not even
    those when their class is listed in ``non_retryable``."""

    max_attempts: int = 3
    initial_seconds: float = 1.0
    maximum_seconds: float = 3600.0
    multiplier: float = 2.0
    non_retryable: frozenset[FailureClass] = frozenset()

    def __post_init__(self) -> None:
        if self.max_attempts < 1 or self.initial_seconds <= 0 or self.multiplier < 1:
            raise ValueError("a retry policy needs max_attempts >= 1, initial_seconds > 0 and "
                             "multiplier >= 1")

    def retries(self, failure: StepFailure) -> bool:
        return failure.retryable and failure.failure_class not in self.non_retryable


@dataclass(frozen=True)
class Step:
    name: str
    run: StepFunction
    timeout_seconds: float = 60.0
    max_attempts: int = 3  # used when ``retry`` is None
    pool: str | None = None  # None: the workflow's pool
    retry: RetryPolicy | None = None
    output_model: type[BaseModel] | None = None  # the output must fit it (else: verifier)
    # Stream the step's model calls (``ctx.provider.complete`` is made a streamed call):
    # clients following the job see its text as the model writes it (``output.delta``).
    # "interactive": only a job of that priority streams (nobody watches a bulk job).
    # A step may also stream a call of its own choosing with ``ctx.provider.stream``.
    stream: bool | Literal["interactive"] = False
    # The models this step may call, in order of preference (calmq.calls.fallback): each call goes
    # to the first that is not cooling down after a 429 or blocked; a model outside the list
    # never serves it. Empty: the worker's model (CALMQ_MODEL) alone, which waits out a
    # cooldown as before.
    models: tuple[str, ...] = ()
    # A price ceiling, USD per million tokens: a model of ``models`` whose input or output
    # price is above it, or that has no price, is left out (checked when the worker starts).
    max_price_per_mtok: float | None = None

    def __post_init__(self) -> None:
        if len(set(self.models)) != len(self.models) or not all(
                isinstance(m, str) and m.strip() == m and m for m in self.models):
            raise ValueError(f"step {self.name}: models are distinct, non-empty model names "
                             f"without spaces at either end: {self.models!r}")
        if self.max_price_per_mtok is not None and not self.max_price_per_mtok > 0:
            raise ValueError(f"step {self.name}: max_price_per_mtok is a price above 0 (USD "
                             "per million tokens)")

    def streams(self, priority: str) -> bool:
        """Whether this step's model calls stream for a job of ``priority``."""
        return self.stream is True or (self.stream == "interactive"
                                       and priority == Priority.INTERACTIVE)

    @property
    def attempts(self) -> int:
        return self.retry.max_attempts if self.retry is not None else self.max_attempts

    def check_output(self, output: dict[str, Any]) -> dict[str, Any]:
        """The output as its model dumps it; ``malformed_output`` when it does not fit, or
        holds a number that is not finite (no row can hold it: the outcome would be lost)."""
        if self.output_model is not None:
            try:
                output = self.output_model.model_validate(output).model_dump(mode="json")
            except ValidationError as exc:
                raise StepFailure(
                    f"step {self.name} output does not fit {self.output_model.__name__}: "
                    f"{exc.errors()[0]['msg']}",
                    code="malformed_output", failure_class=FailureClass.VERIFIER,
                ) from exc
        found = non_finite(output, "output")
        if found is not None:
            raise StepFailure(f"step {self.name} output holds a number that is not finite "
                              f"in {found}", code="malformed_output",
                              failure_class=FailureClass.VERIFIER)
        return output


ReviewExpiry = Literal["dead_letter", "approve"]


@dataclass(frozen=True)
class KeyRateLimit:
    """A rate limit per concurrency key (``Workflow.key_rate_limit``): at most ``requests``
    model calls and/or ``tokens`` tokens (prompt estimate plus max output, settled with what
    the provider counted) per ``per_seconds``, fleet-wide. A token bucket: the whole amount
    is there at first and refills evenly over the window, so no window of ``per_seconds``
    ever sees more than twice it, and a long run averages it."""

    requests: int | None = None
    tokens: int | None = None
    per_seconds: float = 60.0

    def __post_init__(self) -> None:
        if self.requests is None and self.tokens is None:
            raise ValueError("a key rate limit counts requests, tokens or both")
        for name, value in (("requests", self.requests), ("tokens", self.tokens)):
            if value is not None and value < 1:
                raise ValueError(f"a key rate limit's {name} is at least 1")
        # At most a day: a bucket idle for a day is full again whatever its window, and
        # the housekeeping drops it then (calmq.calls.key_rates).
        if not 0 < self.per_seconds <= 86_400:
            raise ValueError("a key rate limit's window (per_seconds) is above 0 and at most "
                             "a day (86400)")

    def as_detail(self) -> dict[str, object]:
        """The limit as the job's history shows it."""
        return {k: v for k, v in (("requests", self.requests), ("tokens", self.tokens),
                                  ("per_seconds", self.per_seconds)) if v is not None}


@dataclass(frozen=True)
class ByReference:
    """What a workflow accepts as input by reference (a multipart ``file`` or ``input_ref``).

    The API checks an object against it before it accepts the job (its media type and size,
    read from the store without reading the object), and the worker reads it bounded by
    ``max_bytes``. ``streams``: the first step reads the object itself, in chunks (it gets
    ``{"input_ref": uri}``); otherwise the worker reads it, and its text (``{"text": ...}``)
    or JSON object goes through the workflow's input model like an inline input.
    """

    content_types: frozenset[str]
    max_bytes: int
    streams: bool = False

    def __post_init__(self) -> None:
        if self.max_bytes < 1 or not self.content_types:
            raise ValueError("input by reference needs max_bytes >= 1 and a content type")

    def check(self, workflow: str, content_type: str, size: int) -> None:
        """ContractError (415 ``unsupported_input_type``, 413 ``input_too_large``) unless an
        object of this media type and size is accepted."""
        kind = content_type.split(";", 1)[0].strip().lower()
        if kind not in self.content_types:
            raise ContractError(
                f"workflow {workflow} does not accept {kind or 'untyped'} input by reference;"
                f" it accepts {', '.join(sorted(self.content_types))}",
                code="unsupported_input_type", status=415)
        if size > self.max_bytes:
            raise ContractError(
                f"the referenced input is {size} bytes; workflow {workflow} accepts at most "
                f"{self.max_bytes} bytes by reference", code="input_too_large", status=413)


@dataclass(frozen=True)
class Workflow:
    name: str
    version: int
    input_model: type[BaseModel]
    steps: tuple[Step, ...]
    pool: str = "default"
    review_threshold: float | None = 0.9
    # None: the review_deadline_seconds setting (48 h by default).
    review_deadline_seconds: float | None = None
    # What the review timer does with a review nobody decided in time.
    review_expiry: ReviewExpiry = "dead_letter"
    meta: dict[str, Any] = field(default_factory=dict)
    # None: the workflow takes no input by reference (input_ref_not_accepted).
    by_reference: ByReference | None = None
    # The lane of its bulk jobs submitted without one: "batch" for a backfill workflow
    # (calmq.lanes.default_lane; an interactive job or a short deadline stays online).
    bulk_lane: Literal["online", "batch"] = "online"
    # At most this many of one concurrency key's jobs (a submit's ``concurrency_key``, e.g. a
    # customer inside the tenant) in flight at once, fleet-wide; 1: one at a time. None: keys
    # limit nothing. Jobs past it wait in queued (waiting_reason concurrency_key).
    concurrency_limit: int | None = None
    # At most so many model requests and/or tokens per window for one concurrency key,
    # fleet-wide (calmq.calls.key_rates); a call past it waits uncounted (rate_limit_key). None:
    # keys limit no rate. A job without a key is not limited by it.
    key_rate_limit: KeyRateLimit | None = None
    # The deadline_seconds of a job submitted without one (None: no deadline): what its calls'
    # service tier is chosen from (calmq.calls.tiers), and its lane (calmq.lanes).
    deadline_seconds: int | None = None

    def __post_init__(self) -> None:
        if not self.steps:
            raise ValueError(f"workflow {self.name} has no steps")
        if self.deadline_seconds is not None and self.deadline_seconds < 1:
            raise ValueError(f"workflow {self.name}: deadline_seconds is at least 1")
        if self.concurrency_limit is not None and self.concurrency_limit < 1:
            raise ValueError(f"workflow {self.name}: concurrency_limit is at least 1")
        names = [s.name for s in self.steps]
        if len(set(names)) != len(names):
            raise ValueError(f"workflow {self.name} names a step twice: {names}")

    def step(self, name: str) -> Step:
        for step in self.steps:
            if step.name == name:
                return step
        raise ContractError(f"workflow {self.name} v{self.version} has no step {name!r}",
                            code="unknown_step")

    def index(self, name: str) -> int:
        return self.steps.index(self.step(name))

    def next_step(self, name: str) -> Step | None:
        """The step after ``name``, or None when ``name`` is the last."""
        i = self.index(name)
        return self.steps[i + 1] if i + 1 < len(self.steps) else None

    def previous_step(self, name: str) -> Step | None:
        i = self.index(name)
        return self.steps[i - 1] if i > 0 else None

    def pool_of(self, step: Step) -> str:
        return step.pool or self.pool

    def needs_review(self, confidence: float | None) -> bool:
        threshold = self.review_threshold
        return threshold is not None and confidence is not None and confidence < threshold

    def accepts_reference(self) -> ByReference:
        """What this workflow takes by reference; ContractError when it takes nothing."""
        if self.by_reference is None:
            raise ContractError(f"workflow {self.name} takes no input by reference (a file "
                                "or input_ref); send input", code="input_ref_not_accepted",
                                status=422)
        return self.by_reference

    def validate_input(self, raw: Any) -> dict[str, Any]:
        try:
            return self.input_model.model_validate(raw).model_dump(exclude_none=True)
        except ValidationError as exc:
            problems = "; ".join(
                f"input.{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
            )
            raise ContractError(
                f"input does not fit workflow {self.name}: {problems}",
                code="invalid_input", status=422,
            ) from exc


def any_timed_wait(workflows: Mapping[str, Workflow]) -> bool:
    """Whether jobs of ``workflows`` may wait a set time, uncounted: a step names its
    allowed models (calmq.calls.fallback) or the workflow a key rate limit
    (calmq.calls.key_rates)."""
    return any(w.key_rate_limit is not None or any(step.models for step in w.steps)
               for w in workflows.values())


def builtin_workflows(settings: Settings | None = None) -> dict[str, Workflow]:
    """The examples shipped with calmq: summarize, invoice, embed_document (and the
    embed_batch its children run), draft."""
    from calmq.workflows.draft import DRAFT
    from calmq.workflows.embed_document import EMBED_BATCH, EMBED_DOCUMENT
    from calmq.workflows.invoice import invoice_workflow
    from calmq.workflows.summarize import SUMMARIZE

    ledger_url = settings.ledger_url if settings is not None else ""
    found = [SUMMARIZE, invoice_workflow(ledger_url), EMBED_DOCUMENT, EMBED_BATCH, DRAFT]
    return {w.name: w for w in found}


def load_workflows(settings: Settings | None = None) -> dict[str, Workflow]:
    """The registry the API and the workers share: the built-in workflows, then every entry
    point of the group ``calmq.workflows``, then each module of the ``workflow_modules``
    setting. See calmq.workflows.registry for what an entry may be."""
    from calmq.workflows.registry import load

    return load(settings)


def find_workflow(name: str, registry: dict[str, Workflow] | None = None) -> Workflow:
    workflows = registry if registry is not None else builtin_workflows()
    try:
        return workflows[name]
    except KeyError:
        raise ContractError(
            f"unknown workflow {name!r}; known: {', '.join(sorted(workflows))}",
            code="unknown_workflow", status=422,
        ) from None
