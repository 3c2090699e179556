"""The console's review pages read bounded rows (issue 27): with 1,000 pending reviews whose
inputs are 1 MiB each, the queue and one review's page hold the API's memory within a stated
bound, and a review beyond the 1,000 oldest is still reachable by id."""

from __future__ import annotations

import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import psutil  # type: ignore[import-untyped]
import psycopg
import pytest

from calmq.producers.console.session import COOKIE
from calmq.tooling.devstack import StackState
from tests.support.api import console_session, create_tenant
from tests.support.intake import ApiProcess, running_api

pytestmark = pytest.mark.integration

REVIEWS = 1000
INPUT_BYTES = 1 << 20  # each job's inline input: 1 MiB of text (32,768 copies of a 32-byte md5)
# The stated bound: the API's resident memory grows by less than this while the pages are
# served. Reading the inputs in the list (the old query) would bring 1,000 MiB across.
RSS_GROWTH_LIMIT_MIB = 64
OUTPUT = '{"vendor": "ACME", "invoice_number": "A-1", "total": 12.5, "currency": "EUR"}'


@pytest.fixture(scope="module")
def api(stack: StackState) -> Iterator[ApiProcess]:
    """An API process of this module's own, so its memory is this test's alone."""
    with running_api(stack) as process:
        yield process


def _seed(db_url: str, tenant_id: uuid.UUID) -> list[uuid.UUID]:
    """REVIEWS jobs of the tenant waiting for a person, oldest first, each with a 1 MiB
    input and the model's output (written as a worker leaves them; no outbox: nothing runs)."""
    with psycopg.connect(db_url, autocommit=True) as conn:
        rows = conn.execute(
            "WITH made AS ("
            " INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority,"
            "  pool, step, attempt, max_attempts, input, created_at, updated_at)"
            " SELECT gen_random_uuid(), %(tenant)s, 'invoice', 1, 'awaiting_review', 'bulk',"
            "  'review-reads', 'extract_fields', 1, 3,"
            "  jsonb_build_object('text', repeat(md5(i::text), %(repeat)s)),"
            "  now() - make_interval(secs => %(n)s - i), now() - make_interval(secs => %(n)s - i)"
            " FROM generate_series(1, %(n)s) AS i"
            " RETURNING id, updated_at)"
            "SELECT id FROM made ORDER BY updated_at",
            {"tenant": tenant_id, "repeat": INPUT_BYTES // 32, "n": REVIEWS}).fetchall()
        ids = [r[0] for r in rows]
        conn.execute(
            "INSERT INTO step_outputs (job_id, step, state, output, confidence)"
            " SELECT id, 'extract_fields', 'pending_review', %s::jsonb, 0.4"
            " FROM unnest(%s::uuid[]) AS id", (OUTPUT, ids))
    return ids


def _get(url: str, session: str) -> tuple[int, str]:
    req = urllib.request.Request(url, headers={"Cookie": f"{COOKIE}={session}"})
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def test_a_thousand_reviews_with_1_mib_inputs_keep_the_review_pages_small(
        stack: StackState, api: ApiProcess) -> None:
    """1,000 pending reviews with 1 MiB inputs: the review queue, its JSON and the newest
    review's page (beyond the 1,000 oldest) answer 200, each page under 1 MiB, and the API's
    RSS grows by less than RSS_GROWTH_LIMIT_MIB across ten views of each."""
    db_url = stack.env["CALMQ_DATABASE_URL"]
    name = f"review-reads-{uuid.uuid4().hex[:8]}"
    key = create_tenant(db_url, name)
    with psycopg.connect(db_url, autocommit=True) as conn:
        row = conn.execute("SELECT id FROM tenants WHERE name = %s", (name,)).fetchone()
    assert row is not None
    ids = _seed(db_url, row[0])
    try:
        session = console_session(api.url, key)
        process = psutil.Process(api.pid)
        before = process.memory_info().rss
        peak = before
        newest = ids[-1]
        for _ in range(10):
            for path in ("/console/reviews", "/console/reviews.json",
                         f"/console/reviews/{newest}"):
                status, body = _get(api.url + path, session)
                assert status == 200, (path, body[:500])
                assert len(body.encode()) < INPUT_BYTES, (path, len(body))
                peak = max(peak, process.memory_info().rss)
        status, body = _get(f"{api.url}/console/reviews/{newest}", session)
        assert str(newest) in body
        growth_mib = (peak - before) / (1 << 20)
        assert growth_mib < RSS_GROWTH_LIMIT_MIB, f"API RSS grew {growth_mib:.1f} MiB"
    finally:
        with psycopg.connect(db_url, autocommit=True) as conn:
            conn.execute("DELETE FROM jobs WHERE id = ANY(%s::uuid[])", (ids,))
