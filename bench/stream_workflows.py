"""The bench-only workflow of ``calmq bench streaming``'s baseline: the built-in ``draft``
step with ``stream=False``, so the same jobs run with the same call length and nothing is
streamed. The API and the workers register it through ``CALMQ_WORKFLOW_MODULES``."""

from __future__ import annotations

from calmq.workflows import Step, Workflow
from calmq.workflows.draft import DraftInput, DraftOutput, draft

__all__ = ["NAME", "WORKFLOWS"]

NAME = "draft_whole"

WORKFLOWS = [Workflow(
    name=NAME, version=1, input_model=DraftInput,
    steps=(Step("draft", draft, timeout_seconds=120.0, max_attempts=3, stream=False,
                output_model=DraftOutput),),
    review_threshold=None,
)]
