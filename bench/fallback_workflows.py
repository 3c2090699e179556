"""The cooldown run's workflow (``calmq bench fairness``): ``summarize`` whose step allows
``fake-small`` then ``fake-large`` (calmq.calls.fallback), on the default pool. Loaded by the
bench's API and worker with ``CALMQ_WORKFLOW_MODULES=bench.fallback_workflows``."""

from __future__ import annotations

from dataclasses import replace

from calmq.settings import Settings
from calmq.workflows import Workflow
from calmq.workflows.summarize import SUMMARIZE

WORKFLOW = "summarize_fallback"
FIRST, SECOND = "fake-small", "fake-large"  # both priced in calmq.calls.pricing.DEFAULT_PRICES


def workflows(settings: Settings) -> list[Workflow]:
    return [replace(SUMMARIZE, name=WORKFLOW,
                    steps=(replace(SUMMARIZE.steps[0], models=(FIRST, SECOND)),))]
