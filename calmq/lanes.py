"""Lanes: how a job reaches the model. ``online`` calls the provider's API at once (at the
online price, under the token budget); ``batch`` waits in a provider batch (OpenAI Batch,
Anthropic Message Batches) for up to the provider's completion window, at the batch price.

The rule a submit must meet for the batch lane lives here, so the API and the client
library refuse the same submissions with the same codes (docs/how-to/batch-backfills.md).
"""

from __future__ import annotations

from calmq.errors import ContractError
from calmq.jobs import Priority

__all__ = ["BATCH", "DEFAULT_MARGIN_SECONDS", "DEFAULT_WINDOW_SECONDS", "LANES", "ONLINE",
           "check_lane", "choose_lane"]

ONLINE = "online"
BATCH = "batch"
LANES = (ONLINE, BATCH)
# OpenAI's and Anthropic's completion window, and the margin a deadline must leave past it
# (the settings' defaults; the client library, which has no settings, uses these).
DEFAULT_WINDOW_SECONDS = 24 * 3600.0
DEFAULT_MARGIN_SECONDS = 3600.0


def check_lane(lane: str, priority: str, deadline_seconds: int | None, *,
               window_seconds: float = DEFAULT_WINDOW_SECONDS,
               margin_seconds: float = DEFAULT_MARGIN_SECONDS) -> None:
    """Refuse a submission the batch lane cannot serve (a ContractError with its code).

    Refused, not routed online: a caller who asked for the batch price and gets the online
    one (or who asked for a deadline and gets it missed) would learn it from the bill.
    """
    if lane not in LANES:
        raise ContractError(f"lane is one of {', '.join(LANES)}", code="invalid_lane",
                            status=422)
    if lane != BATCH:
        return
    if priority != Priority.BULK:
        raise ContractError(
            "the batch lane is for bulk work: send priority bulk (or leave it out) with "
            "lane batch", code="batch_lane_needs_bulk", status=422)
    needed = window_seconds + margin_seconds
    if deadline_seconds is not None and deadline_seconds < needed:
        raise ContractError(
            f"a batch-lane job's deadline must be at least {needed:g} s (the provider's "
            f"{window_seconds:g} s completion window plus a {margin_seconds:g} s margin); "
            f"got {deadline_seconds} s: submit it online or give it a longer deadline",
            code="deadline_too_short_for_batch", status=422)


def choose_lane(lane: str | None, priority: str, deadline_seconds: int | None, *,
                bulk_lane: str = ONLINE, window_seconds: float = DEFAULT_WINDOW_SECONDS,
                margin_seconds: float = DEFAULT_MARGIN_SECONDS) -> str:
    """The lane of a submission: the one it asked for (checked by ``check_lane``), else its
    workflow's lane for bulk work (``Workflow.bulk_lane``) when the job fits that lane, else
    online. A default never refuses a job: one the batch lane cannot serve goes online."""
    if lane is not None:
        check_lane(lane, priority, deadline_seconds, window_seconds=window_seconds,
                   margin_seconds=margin_seconds)
        return lane
    if bulk_lane != BATCH or priority != Priority.BULK:
        return ONLINE
    if deadline_seconds is not None and deadline_seconds < window_seconds + margin_seconds:
        return ONLINE
    return BATCH
