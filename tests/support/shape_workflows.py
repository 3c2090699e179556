"""The built-in workflows, as registered, on the worker's own pool (``CALMQ_POOL``): the
provider-shape tests (tests/integration/test_provider_shapes.py) run every built-in
workflow's every step on workers of their own, against a fake provider of their own, so the
stack's own worker (pool ``default``) never runs them."""

from __future__ import annotations

from dataclasses import replace

from calmq.settings import Settings
from calmq.workflows import Workflow
from calmq.workflows.embed_document import EMBED_DOCUMENT
from calmq.workflows.invoice import invoice_workflow
from calmq.workflows.summarize import SUMMARIZE


def workflows(settings: Settings) -> list[Workflow]:
    pool = settings.pool
    return [
        replace(SUMMARIZE, name="summarize_s", pool=pool),
        invoice_workflow(settings.ledger_url, name="invoice_s", pool=pool),
        replace(EMBED_DOCUMENT, name="embed_s", pool=pool),
    ]
