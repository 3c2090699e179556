"""Test workflows, registered in the API and worker processes the workflow tests start
(``CALMQ_WORKFLOW_MODULES=tests.support.workflows``). They route to the test pools, so the
stack's own worker (pool ``default``) never runs them."""

from __future__ import annotations

from dataclasses import replace

from calmq.settings import Settings
from calmq.workflows import Workflow
from calmq.workflows.draft import DRAFT
from calmq.workflows.embed_document import EMBED_DOCUMENT
from calmq.workflows.invoice import invoice_workflow
from calmq.workflows.summarize import SUMMARIZE

POOL = "wft"  # text extraction and model calls
LEDGER_POOL = "wft-ledger"  # the side effect, on workers of its own
# The review-cap tests' pool: a cap counts every pending review and every job on its way to
# one in its pool, so the jobs other tests leave in POOL (a review decided, a job finishing)
# would move the count under the test.
CAPS_POOL = "wft-caps"
POOLS = (POOL, LEDGER_POOL, CAPS_POOL)
EXPIRY_SECONDS = 1.0


def workflows(settings: Settings) -> list[Workflow]:
    def invoice(name: str, pool: str = POOL, **kw: object) -> Workflow:
        return invoice_workflow(settings.ledger_url, name=name, pool=pool,
                                ledger_pool=LEDGER_POOL, **kw)  # type: ignore[arg-type]

    return [
        invoice("invoice_t"),
        invoice("invoice_t_capped", pool=CAPS_POOL),
        invoice("invoice_t_expires", review_deadline_seconds=EXPIRY_SECONDS),
        invoice("invoice_t_expires_approved", review_deadline_seconds=EXPIRY_SECONDS,
                review_expiry="approve"),
        replace(SUMMARIZE, name="summarize_t", pool=POOL),
        replace(EMBED_DOCUMENT, name="embed_t", pool=POOL),
        replace(DRAFT, name="draft_t", pool=POOL),
    ]
