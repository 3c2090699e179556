"""Idempotent side effects: "record then call then confirm".

A step that posts to an external system (a ledger, an email service) wraps the call in
``once``. The intent is recorded before the call and the answer after it; when a crash
falls between the two, the next attempt calls again with the SAME idempotency key, which
the external system uses to answer the first posting instead of making a second one. An
effect that was confirmed is never called again: its recorded answer is returned.
Exactly-once therefore needs the external system to honour the key; calmq guarantees the
key is stable and that a confirmed effect is not repeated.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from calmq.data.steps import EffectRecord
from calmq.errors import FailureClass, StepFailure

if TYPE_CHECKING:
    from calmq.workflows import StepContext

# The log in PostgreSQL is calmq.data.steps.SideEffects.
__all__ = ["MemoryEffectLog", "once"]


async def once(
    ctx: StepContext, name: str, call: Callable[[str], Awaitable[dict[str, Any]]]
) -> dict[str, Any]:
    """Run ``call(idempotency_key)`` at most once to confirmation; return its answer."""
    key = f"{ctx.idempotency_key}:{name}"
    log = ctx.effects
    if log is None:
        raise StepFailure("this step needs the side-effect log (run it through a worker or pass "
                          "StepContext.effects)", code="no_effect_log",
                          failure_class=FailureClass.BUG)
    earlier = await log.lookup(ctx.job_id, key)
    if earlier is not None and earlier.state == "confirmed":
        return earlier.response or {}
    await log.called(ctx.job_id, key)
    response = await call(key)
    await log.confirmed(ctx.job_id, key, response)
    return response


class MemoryEffectLog:
    """The same interface in memory, for testing a step alone."""

    def __init__(self) -> None:
        self.records: dict[tuple[str, str], EffectRecord] = {}

    async def lookup(self, job_id: str, key: str) -> EffectRecord | None:
        return self.records.get((job_id, key))

    async def called(self, job_id: str, key: str) -> int:
        record = self.records.setdefault((job_id, key), EffectRecord("called", 0))
        record.calls += 1
        return record.calls

    async def confirmed(self, job_id: str, key: str, response: dict[str, Any]) -> None:
        record = self.records[(job_id, key)]
        record.state, record.response = "confirmed", response
