"""Every failure code calmq raises, declared once: its class, whether it is retried, what it
does to the token budget, the HTTP problem where one exists, and its line in the docs.

The gateway's ``classify_status`` builds its failures from here (``failure``), the failure
stage and the retry policy read ``retried``, the budget reads ``budget`` (``refund``: the
provider refused the call or never got it, so its reservation goes back whole; ``keep``: the
provider may have counted it; ``pause``: the provider and model are the fleet's
configuration problem once a probe call or a second job confirms it (calmq.calls.gate), so
they pause fleet-wide and the job waits, no attempt counted), and
the failure table in docs/reference/providers.md is checked against ``docs_table()``.
``tests/unit/test_failure_codes.py`` fails when calmq raises a code this registry lacks.

A workflow's own codes need no entry: an unknown code is read from its failure class
(retried when ``transient``, its budget effect ``keep``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Final

from calmq.errors import FailureClass, StepFailure

__all__ = ["CODES", "BudgetEffect", "FailureCode", "KeyRateLimited", "ModelsCooling",
           "ProviderBlocked", "WaitUncounted", "docs_table", "failure", "spec"]


class BudgetEffect(StrEnum):
    REFUND = "refund"  # the provider refused the call or never got it: nothing counted
    KEEP = "keep"  # the provider may have counted it: the estimate stays spent
    # confirmed by a probe call or a second job: the provider/model is blocked fleet-wide
    # until a probe call succeeds; unconfirmed: the job's own failure, as its class says
    PAUSE = "pause"


@dataclass(frozen=True)
class FailureCode:
    code: str
    failure_class: FailureClass
    budget: BudgetEffect
    docs: str  # what it means, for the docs' table
    http_problem: int | None = None  # the status an API answers with, where one exists
    provider_status: str = ""  # the provider answer it stands for (docs), "" if none

    @property
    def retried(self) -> bool:
        """Only transient failures are retried (and only with attempts left); a paused one is
        not an attempt at all."""
        return self.failure_class is FailureClass.TRANSIENT and self.budget != BudgetEffect.PAUSE

    @property
    def pauses(self) -> bool:
        return self.budget is BudgetEffect.PAUSE


T, IN, P, PO, V, D, B = (FailureClass.TRANSIENT, FailureClass.INPUT, FailureClass.PERMISSION,
                        FailureClass.POLICY, FailureClass.VERIFIER, FailureClass.DEADLINE,
                        FailureClass.BUG)
R, K, PA = BudgetEffect.REFUND, BudgetEffect.KEEP, BudgetEffect.PAUSE

_ALL: Final = (
    # -- the provider's answers (calmq.calls.wires.classify_status) ---------------------------
    FailureCode("rate_limited", T, R, "rate limited: waits retry-after-ms / retry-after "
                "(at most provider_retry_after_max_seconds), fleet-wide for that provider "
                "and model, then retried",
                provider_status="429"),
    FailureCode("flex_unavailable", T, R, "OpenAI's flex tier has no capacity for the call "
                "(429 resource_unavailable): sent again at once at the standard tier in the "
                "same attempt (calmq.calls.tiers); nothing paused",
                provider_status="429 resource_unavailable"),
    FailureCode("upstream_unavailable", T, R, "the provider failed; retried with backoff, "
                "never sooner than Retry-After", provider_status="500, 502, 503, 504"),
    FailureCode("provider_overloaded", T, R, "Anthropic's overloaded_error; retried with "
                "backoff", provider_status="529, or a 5xx naming overloaded_error"),
    FailureCode("timeout", T, K, "no answer within the step's timeout (the provider may have "
                "counted the call)", provider_status="408, client timeout"),
    FailureCode("connection_error", T, R, "the provider could not be reached, or the "
                "connection broke before the answer's headers", provider_status="refused, reset"),
    FailureCode("upstream_garbled", T, K, "a 2xx that is not JSON, is cut off mid-body or "
                "lacks the answer", provider_status="2xx, unreadable"),
    FailureCode("stream_interrupted", T, K, "a streamed answer broke off after it began (the "
                "connection, the provider's error event, no last event): retried with a new "
                "stream, clients are told to reset", provider_status="2xx stream cut off"),
    FailureCode("provider_auth", P, PA, "the key is wrong or revoked: once a probe call or "
                "a second job confirms it, the provider and model pause fleet-wide and jobs "
                "wait queued; unconfirmed, the job's own (dead letter)", provider_status="401"),
    FailureCode("provider_permission", P, PA, "the key may not use this model or endpoint "
                "(or a firewall refused one request): confirmed, the provider and model "
                "pause fleet-wide; unconfirmed, the job's own", provider_status="403"),
    FailureCode("model_not_found", P, PA, "the model does not exist or the account cannot "
                "use it: confirmed, the provider and model pause fleet-wide; unconfirmed, "
                "the job's own", provider_status="404"),
    FailureCode("insufficient_quota", P, PA, "billing: the account's quota or credit is used "
                "up (read from the error's code or type, never its message): confirmed, "
                "the provider and model pause fleet-wide",
                provider_status="429 insufficient_quota, 402 billing_error"),
    FailureCode("context_length_exceeded", IN, R, "the prompt is longer than the model's "
                "context: the job's input", provider_status="400 context_length_exceeded"),
    FailureCode("request_too_large", IN, R, "the request body is over the provider's size "
                "limit: the job's input", provider_status="413"),
    FailureCode("content_policy", PO, R, "refused by the provider's content policy",
                provider_status="400 content_policy / content_filter"),
    FailureCode("provider_bad_request", IN, R, "any other request the provider refused",
                provider_status="other 400, 409, 422"),
    # -- the step's reading of the answer ---------------------------------------------------
    FailureCode("model_refusal", PO, K, "the model refused in a 2xx answer (raised by the "
                "step)"),
    FailureCode("malformed_output", V, K, "the output is not the step's output model"),
    FailureCode("no_embeddings", P, K, "the configured embeddings provider cannot embed"),
    FailureCode("not_supported", IN, R, "the provider has no such API (e.g. embeddings)"),
    # -- the batch lane ------------------------------------------------------------------------
    FailureCode("batch_expired", T, R, "the provider's batch expired before this request ran"),
    FailureCode("batch_cancelled", T, R, "the batch was cancelled before this request ran"),
    FailureCode("batch_result_missing", T, R, "the batch ended without this request's result"),
    FailureCode("batch_result_unreadable", T, K, "this request's line of the batch's results "
                "file is not JSON or not the provider's result shape; retried in a later batch"),
    FailureCode("batch_result_too_large", IN, K, "this request's result line is longer than "
                "batch_max_result_line_bytes: skipped unread, not retried"),
    FailureCode("batch_failed", T, R, "the provider failed the whole batch (no line of it "
                "named): retried in a later batch"),
    FailureCode("batch_multi_call", B, K, "a batch-lane step made a second model call"),
    FailureCode("batch_unknown_job", B, K, "a batch-lane model call outside its attempt"),
    # -- the attempt --------------------------------------------------------------------------
    FailureCode("deadline_exceeded", D, K, "the job's deadline passed before it could run"),
    FailureCode("infrastructure_error", T, K, "the database or object store was away while "
                "the step ran"),
    FailureCode("artifact_write_failed", T, K, "the result could not be stored"),
    FailureCode("unhandled_exception", B, K, "the step raised something it did not classify"),
    FailureCode("unknown_workflow", IN, K, "no workflow of that name on this worker", 422),
    FailureCode("unknown_step", IN, K, "the workflow version has no such step"),
    FailureCode("missing_input", IN, K, "the job has neither input nor input_ref"),
    FailureCode("invalid_input", IN, K, "the input does not fit the workflow's input model",
                422),
    FailureCode("input_too_large", IN, K, "input by reference over the workflow's limit", 413),
    FailureCode("unsupported_input_type", IN, K, "input by reference of a media type the "
                "workflow does not take", 415),
    FailureCode("input_ref_not_accepted", IN, K, "the workflow takes no input by reference",
                422),
    FailureCode("poison", IN, K, "every attempt ended with its worker (killed, out of memory) "
                "up to the attempt budget"),
    FailureCode("missing_step_output", B, K, "a step's recorded output is missing"),
    FailureCode("no_effect_log", B, K, "a step asked for the side-effect log without one"),
    FailureCode("no_object_store", B, K, "a step needs the object store"),
    # -- the built-in workflows -------------------------------------------------------------
    FailureCode("empty_invoice", IN, K, "invoice: no text to read"),
    FailureCode("unreadable_pdf", IN, K, "invoice: the PDF cannot be read"),
    FailureCode("ledger_not_configured", IN, K, "invoice: no ledger_url setting"),
    FailureCode("ledger_rejected", IN, K, "invoice: the ledger refused the posting"),
    FailureCode("ledger_unavailable", T, K, "invoice: the ledger answered 429 or 5xx"),
    FailureCode("ledger_unreachable", T, K, "invoice: the ledger could not be reached"),
    FailureCode("empty_document", IN, K, "embed_document: the document has no text"),
    FailureCode("too_many_children", IN, K, "a step started more child jobs than "
                "children_per_parent_max; none was started"),
    FailureCode("children_too_deep", IN, K, "a child job nested children_depth_max deep "
                "started children; none was started"),
    FailureCode("children_failed", IN, K, "the join of a job's child jobs can no longer hold "
                "(a child of an all join failed, or too many for at least k); the error "
                "names the failed children"),
    FailureCode("spawn_without_next_step", B, K, "the last step of a workflow started child "
                "jobs: a next step must join them"),
)

CODES: Final[dict[str, FailureCode]] = {c.code: c for c in _ALL}
assert len(CODES) == len(_ALL), "a failure code is declared twice"


def spec(code: str, failure_class: FailureClass = FailureClass.BUG) -> FailureCode:
    """The registry's entry for ``code``; a workflow's own code is read from its class."""
    found = CODES.get(code)
    if found is not None:
        return found
    return FailureCode(code, failure_class, BudgetEffect.KEEP, "a workflow's own code")


def failure(code: str, message: str, *, retry_after: float | None = None) -> StepFailure:
    """A StepFailure of a registered code, with the class the registry gives it."""
    entry = CODES[code]
    return StepFailure(message, code=code, failure_class=entry.failure_class,
                       retry_after=retry_after)


class ProviderBlocked(StepFailure):
    """The provider and model are blocked fleet-wide (a bad key, a missing permission, a
    model the account cannot use, exhausted billing, each confirmed by a probe call or a
    second job: calmq.calls.gate): not the job's fault. The job is handed back to wait
    (``waiting_reason`` ``provider_blocked``) with no attempt counted, and runs again when
    the block lifts (a probe call succeeded, or ``calmq provider unblock``).

    ``met``: the job's own call got the refusal (not a call refused here before it was
    sent). Such a job is handed back uncounted once; meeting it again after the block
    lifted, it ends in dead letter with the code, rather than being sent again at every
    unblock for ever."""

    def __init__(self, message: str, *, code: str, provider: str, model: str,
                 met: bool = False) -> None:
        super().__init__(message, code=code, failure_class=CODES[code].failure_class)
        self.provider = provider
        self.model = model
        self.met = met


class WaitUncounted(StepFailure):
    """A call that was not made because what it needs has no room for ``seconds`` yet: not
    the job's attempt. The pipeline hands the job back to wait in ``queued``
    (``waiting_reason``: ``reason``, event ``waiting`` with ``detail``) with no attempt
    counted, until ``seconds`` have passed and the release pass re-publishes it. Outside a
    worker's pipeline (a step tested alone) it reads as the 429 it stands for:
    ``rate_limited``, never retried sooner than ``retry_after``."""

    reason = "waiting"

    def __init__(self, message: str, seconds: float, detail: dict[str, object]) -> None:
        super().__init__(message, code="rate_limited", failure_class=FailureClass.TRANSIENT,
                         retry_after=seconds)
        self.seconds = seconds
        self.detail = detail


class ModelsCooling(WaitUncounted):
    """Every model the step allows is cooling down after a 429 (calmq.calls.fallback)."""

    reason = "model_cooldown"

    def __init__(self, seconds: float, models: Sequence[str]) -> None:
        super().__init__(
            f"every allowed model is cooling down ({', '.join(models)}): the job waits "
            f"{seconds:.1f} s, no attempt counted", seconds,
            {"models": list(models), "seconds": round(seconds, 3)})
        self.models = tuple(models)


class KeyRateLimited(WaitUncounted):
    """The job's concurrency key used its workflow's rate limit (requests or tokens per
    window, calmq.calls.key_rates): the call waits for the key's bucket to refill."""

    reason = "rate_limit_key"

    def __init__(self, seconds: float, key: str, limit: dict[str, object]) -> None:
        super().__init__(
            f"concurrency key {key!r} is at its rate limit ({limit}): the job waits "
            f"{seconds:.1f} s, no attempt counted", seconds,
            {"key": key, "limit": limit, "seconds": round(seconds, 3)})
        self.key = key


def docs_table() -> str:
    """The provider failures as the docs' table (docs/reference/providers.md)."""
    rows = ["| provider answer | code | class | retried | budget: what happens |",
            "|---|---|---|---|---|"]
    for c in _ALL:
        if not c.provider_status:
            continue
        rows.append(f"| {c.provider_status} | `{c.code}` | `{c.failure_class.value}` | "
                    f"{'yes' if c.retried else 'no'} | {c.budget.value}: {c.docs} |")
    return "\n".join(rows)
