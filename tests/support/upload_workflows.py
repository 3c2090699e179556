"""The workflow of the upload test (tests/integration/test_upload_limits.py): the built-in
embed_document's steps, taking text files up to 100 MiB by reference (the API's largest
upload), on a pool of its own that no worker of the stack consumes."""

from __future__ import annotations

from dataclasses import replace

from calmq.settings import Settings
from calmq.workflows import Workflow
from calmq.workflows.embed_document import EMBED_BY_REFERENCE, EMBED_DOCUMENT

WORKFLOW = "bulk_upload_t"
POOL = "uploads-t"
MAX_BYTES = 100 * 1024 * 1024


def workflows(settings: Settings) -> list[Workflow]:
    del settings
    return [replace(EMBED_DOCUMENT, name=WORKFLOW, pool=POOL,
                    by_reference=replace(EMBED_BY_REFERENCE, max_bytes=MAX_BYTES))]
