"""The metering of every model call: its tokens and cost written to its attempt and job,
the estimate a call reserves before the provider counts it, and what a failed call cost.

A call reserves its estimate (prompt tokens + max output tokens) and settles with what the
provider counted (docs/explanation/token-budget.md). A call the provider refused or never
received (429, 5xx, 4xx, no connection) gives its whole reservation back: it counted
nothing. A timeout keeps it (the provider may have counted the call).
"""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

from calmq.calls.caching import CacheUse
from calmq.data.budget import Usage, UsageLedger
from calmq.errors import StepFailure
from calmq.failure_codes import BudgetEffect, spec
from calmq.group_commit import GroupCommitter
from calmq.retrying import RECONNECT

if TYPE_CHECKING:
    from calmq.data import Database

__all__ = ["UsageRecorder", "charged_on_failure", "estimate_prompt_tokens"]


# -- usage: tokens and cost per attempt and per job ---------------------------------------


class UsageRecorder:
    """Writes model calls' tokens and cost to their attempt and job, group-committed.

    For calls made outside a step runner's attempt (the runner carries its attempts' usage
    into the outcome's own transaction), and for an attempt stopped before its outcome was
    written. ``record`` returns once the row is written.
    """

    def __init__(self, db: Database, *, window: float = 0.005) -> None:
        self._usage = UsageLedger(db)
        # One writer: usage rows of one job would contend; retried while the database is
        # away, since an attempt's tokens are spent whether or not they are written.
        self._batcher: GroupCommitter[Usage] = GroupCommitter(
            "usage-recorder", self._usage.add, window=window, max_batch=500, retry=RECONNECT)

    def start(self) -> None:
        self._batcher.start()

    async def close(self) -> None:
        await self._batcher.close(grace=5.0)

    async def record(self, job_id: str, input_tokens: int, output_tokens: int,
                     cost: float, calls: int = 1, *, cache: CacheUse | None = None) -> None:
        try:
            job = uuid.UUID(job_id)
        except ValueError:
            return  # not a calmq job (a hand-made call): nothing to add it to
        # A step cancelled meanwhile (timeout) still has its usage written: the batcher
        # shields the write from its caller.
        cache = cache or CacheUse()
        await self._batcher.submit(Usage(job, input_tokens, output_tokens, cost, calls,
                                         cache.read, cache.written, cache.saved_usd))


# -- a call's estimate and what a failed one cost -----------------------------------------


def estimate_prompt_tokens(messages: list[dict[str, str]]) -> int:
    """About four characters a token, as providers estimate before they tokenize."""
    chars = sum(len(m.get("content") or "") for m in messages)
    return max(1, (chars + 3) // 4)



def charged_on_failure(exc: BaseException, estimate: float) -> float:
    """What a failed call cost the quota, as its code's budget effect says
    (calmq.failure_codes): nothing when the provider refused it or never got it (refund, and
    a pause: refused too); the whole estimate when it may have counted it (a timeout, a
    garbled answer, a step cancelled mid-call)."""
    if isinstance(exc, StepFailure) and spec(exc.code, exc.failure_class).budget in (
            BudgetEffect.REFUND, BudgetEffect.PAUSE):
        return 0.0
    return estimate
