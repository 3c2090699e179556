"""Workflows that their concurrency keys limit, registered in the API and worker processes
of tests/integration/test_concurrency_keys.py
(``CALMQ_WORKFLOW_MODULES=tests.support.keyed_workflows``), on a pool of their own:
``summarize_keyed`` runs at most ``LIMIT`` jobs of a key at once, ``summarize_rated`` at
most ``RATE`` model calls of a key per minute."""

from __future__ import annotations

from dataclasses import replace

from calmq.settings import Settings
from calmq.workflows import KeyRateLimit, Workflow
from calmq.workflows.summarize import SUMMARIZE

KEYED_POOL = "keyed"
LIMIT = 2
RATE = KeyRateLimit(requests=20, per_seconds=60)


def workflows(settings: Settings) -> list[Workflow]:
    return [replace(SUMMARIZE, name="summarize_keyed", pool=KEYED_POOL,
                    concurrency_limit=LIMIT),
            replace(SUMMARIZE, name="summarize_rated", pool=KEYED_POOL, key_rate_limit=RATE)]
