"""Retention: old idempotency keys are forgotten, old finished jobs are purged and redacted."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path
from urllib.parse import urlparse

import psycopg
import pytest

from calmq.data import Store
from calmq.objects import open_object_store
from calmq.producers.retention import Sweeper
from calmq.settings import Settings
from calmq.tooling.devstack import StackState
from tests.support.api import Api, create_tenant
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration


async def _sweep(stack: StackState) -> dict[str, int]:
    settings = Settings(database_url=stack.env["CALMQ_DATABASE_URL"],
                        object_store_url=stack.env["CALMQ_OBJECT_STORE_URL"],
                        idempotency_retention_seconds=3600, job_retention_seconds=7 * 86400)
    store = Store(settings.database_url, max_size=2)
    await store.open()
    try:
        return await Sweeper(settings, store, open_object_store(settings.object_store_url)).sweep()
    finally:
        await store.close()


def test_sweep_forgets_old_keys_and_purges_old_jobs(stack: StackState) -> None:
    """Keys past retention are deleted (the key works anew); finished jobs past it are purged."""
    url = stack.env["CALMQ_DATABASE_URL"]
    api = Api(stack.env["CALMQ_API_URL"], create_tenant(url, f"ret-{uuid.uuid4().hex[:8]}"))
    key = {"Idempotency-Key": f"old-{uuid.uuid4()}"}
    body = {"workflow": "summarize", "input": {"text": "keep me briefly", "mode": "success"}}
    first = api.call("POST", "/v1/jobs", body, headers=key)[2]["job_id"]
    fresh = api.submit({"text": "recent", "mode": "success"})
    for job_id in (first, fresh):
        wait_for(lambda j=job_id: api.job(j)["status"] == "completed", timeout=60,
                 what="the jobs to complete")
    artifact = Path(urlparse(api.job(first)["artifact"]["uri"]).path)
    assert artifact.exists()
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("UPDATE idempotency_keys SET created_at = now() - interval '2 hours' "
                     "WHERE job_id = %s", (first,))
        # Ended (and so created) more than a retention ago.
        conn.execute("UPDATE jobs SET created_at = now() - interval '9 days', "
                     "updated_at = now() - interval '8 days' WHERE id = %s", (first,))

    swept = asyncio.run(_sweep(stack))
    assert swept["idempotency_keys"] >= 1
    assert swept["jobs"] >= 1
    assert not artifact.exists()
    with psycopg.connect(url) as conn:
        rows = dict(conn.execute("SELECT id::text, redacted_at IS NOT NULL FROM jobs "
                                 "WHERE id = ANY(%s)", ([first, fresh],)).fetchall())
    assert rows == {first: True, fresh: False}
    assert api.job(first)["artifact"] is None
    again = api.call("POST", "/v1/jobs", body, headers=key)
    assert again[0] == 202
    assert again[2]["job_id"] != first
