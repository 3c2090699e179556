"""The workflow module of the pods-as-rendered test, set through the rendered ConfigMap
(``CALMQ_WORKFLOW_MODULES=tests.support.k8s_workflows``). Its pools exist only because this
module routes to them, so `calmq k8s render` renders their workers from the module alone,
and the session stack's own worker (pool ``default``) never sees their jobs."""

from __future__ import annotations

from dataclasses import replace

from calmq.settings import Settings
from calmq.workflows import Workflow
from calmq.workflows.summarize import SUMMARIZE

POOL_A = "k8s-a"
POOL_B = "k8s-b"
WORKFLOW_A = "summarize_k8s_a"
WORKFLOW_B = "summarize_k8s_b"


def workflows(settings: Settings) -> list[Workflow]:
    del settings  # nothing of these workflows depends on a setting
    return [replace(SUMMARIZE, name=WORKFLOW_A, pool=POOL_A),
            replace(SUMMARIZE, name=WORKFLOW_B, pool=POOL_B)]
