"""A workflow whose concurrency keys limit it (``concurrency_limit`` 2), registered in the
API and worker processes of tests/integration/test_concurrency_keys.py
(``CALMQ_WORKFLOW_MODULES=tests.support.keyed_workflows``), on a pool of its own."""

from __future__ import annotations

from dataclasses import replace

from calmq.settings import Settings
from calmq.workflows import Workflow
from calmq.workflows.summarize import SUMMARIZE

KEYED_POOL = "keyed"
LIMIT = 2


def workflows(settings: Settings) -> list[Workflow]:
    return [replace(SUMMARIZE, name="summarize_keyed", pool=KEYED_POOL,
                    concurrency_limit=LIMIT)]
