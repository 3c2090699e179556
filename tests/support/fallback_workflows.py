"""Workflows whose step names its allowed models (calmq.calls.fallback), registered in the API and
worker processes of tests/integration/test_fallback.py
(``CALMQ_WORKFLOW_MODULES=tests.support.fallback_workflows``), on a pool of their own:

- ``summarize_fallback``: ``FIRST`` then ``SECOND`` (the test's fake provider answers 429
  for ``FIRST``: the calls move to ``SECOND``);
- ``summarize_cooling``: ``ONLY`` (its 429s leave no other model: the jobs wait for the
  cooldown, uncounted).
"""

from __future__ import annotations

from dataclasses import replace

from calmq.settings import Settings
from calmq.workflows import Workflow
from calmq.workflows.summarize import SUMMARIZE

FALLBACK_POOL = "fallback"
FIRST, SECOND, ONLY = "fb-first", "fb-second", "fb-only"


def workflows(settings: Settings) -> list[Workflow]:
    step = SUMMARIZE.steps[0]
    return [
        replace(SUMMARIZE, name="summarize_fallback", pool=FALLBACK_POOL,
                steps=(replace(step, models=(FIRST, SECOND)),)),
        replace(SUMMARIZE, name="summarize_cooling", pool=FALLBACK_POOL,
                steps=(replace(step, models=(ONLY,)),)),
    ]
