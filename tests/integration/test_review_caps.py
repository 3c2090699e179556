"""Review caps enforced on the real stack: past its pool's cap, a new job that can end in
review waits in queued (event waiting, reason review_cap; no attempt counted) instead of
adding a pending review, and runs by itself once a decision makes room."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.rows import dict_row

from calmq.data import tenants
from calmq.producers.console.session import COOKIE
from calmq.sql import queries
from calmq.tooling.devstack import StackState
from tests.support.api import console_session
from tests.support.waiting import wait_for
from tests.support.workers import metric
from tests.support.workflow_env import WorkflowEnv
from tests.support.workflows import CAPS_POOL as POOL
from tests.support.workflows import LEDGER_POOL

pytestmark = pytest.mark.integration

INVOICE = "Vendor: Blurry Scan Ltd\nInvoice: 7?1\nTotal: EUR 88.00\n"
WORKFLOW = "invoice_t_capped"  # invoice_t on a pool of its own (CAPS_POOL)


@pytest.fixture(scope="module")
def wf(stack: StackState) -> Iterator[WorkflowEnv]:
    # Workers start in the tests (_workers): a worker reads the caps at most every
    # ReviewCapGate.CAPS_TTL, so one started before the cap was set could let the first jobs
    # after it through. Started after it, the worker's first read sees it.
    env = WorkflowEnv(stack, workers=False)
    try:
        yield env
    finally:
        env.sql("DELETE FROM review_caps WHERE pool = %s RETURNING pool", POOL)
        env.close()


def _workers(wf: WorkflowEnv) -> None:
    if not hasattr(wf, "worker"):
        wf.worker, wf.worker_port = wf.start_worker(POOL)
        wf.ledger_worker, wf.ledger_worker_port = wf.start_worker(LEDGER_POOL)


def _page(wf: WorkflowEnv, path: str, session: str) -> str:
    req = urllib.request.Request(wf.api_url + path, headers={"Cookie": f"{COOKIE}={session}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert resp.status == 200
        return str(resp.read().decode())


def _held(job: dict) -> bool:  # type: ignore[type-arg]
    return job["status"] == "queued" and any(
        e["type"] == "waiting" and e["detail"].get("reason") == "review_cap"
        for e in job["events"])


def _states(wf: WorkflowEnv, ids: list[str]) -> tuple[list[str], list[str]]:
    jobs = [wf.job(i) for i in ids]
    return ([i for i, j in zip(ids, jobs, strict=True) if j["status"] == "awaiting_review"],
            [i for i, j in zip(ids, jobs, strict=True) if _held(j)])


def test_jobs_past_the_cap_wait_queued_and_resume_as_reviews_are_decided(
        wf: WorkflowEnv) -> None:
    # Reviews other tests left pending in the pool count against its cap too.
    before = int(wf.sql("SELECT count(*)::int AS n FROM jobs WHERE pool = %s AND "
                        "status = 'awaiting_review'", POOL)[0]["n"])
    cap = before + 2
    wf.sql("INSERT INTO review_caps (pool, cap, updated_by) VALUES (%s, %s, 'test') "
           "ON CONFLICT (pool) DO UPDATE SET cap = EXCLUDED.cap RETURNING pool", POOL, cap)
    _workers(wf)
    ids = [wf.submit(WORKFLOW, {"text": INVOICE, "mode": "low_confidence"})
           for _ in range(4)]

    reviewing, held = wait_for(
        lambda: (s := _states(wf, ids)) and len(s[0]) + len(s[1]) == 4 and s,
        timeout=60, what="two reviews pending and two jobs held for the cap")
    # On a failure, what the pool held and what each job went through.
    story = (before, reviewing, held, wf.sql(
        "SELECT status, waiting_reason, review_deadline_at IS NOT NULL AS deadline, "
        "count(*)::int AS n FROM jobs WHERE pool = %s GROUP BY 1, 2, 3", POOL),
        {i: [(e["type"], e["detail"], e["at"]) for e in wf.job(i)["events"]] for i in ids})
    assert len(reviewing) == 2, story
    assert len(held) == 2, story
    for job_id in held:
        job = wf.job(job_id)
        # (A worker that just started may hold it in its lane's waiting room first: fair
        # share decides before the review cap, which counts what it admits until the claim.)
        waiting = [e["detail"] for e in job["events"]
                   if e["type"] == "waiting" and e["detail"]["reason"] != "fair_share"]
        assert waiting == [{"reason": "review_cap", "pool": POOL, "cap": cap,
                            "pending": waiting[0]["pending"]}], waiting
        assert waiting[0]["pending"] >= cap
        assert wf.attempts(job_id) == {}  # waiting for the cap is no attempt
        assert job["attempt"] == 0
    assert metric(wf.worker_port, "calmq_review_cap") == cap  # the cap the worker enforces

    # The console's overview says the pool is past its cap and how many jobs wait for it;
    # a held job's page gives the reason.
    platform = console_session(wf.api_url, tenants.add_key(wf.db, tenants.PLATFORM_TENANT,
                                                           None, platform=True))
    overview = _page(wf, "/console/overview", platform)
    assert f"<td>{POOL}</td><td>{cap}</td><td>{cap}</td>" in overview  # pending, cap
    assert f"past the cap ({cap} pending, cap {cap})" in overview
    assert "(2 waiting)" in overview
    assert "reason <code>review_cap</code>" in _page(wf, f"/console/jobs/{held[0]}", platform)

    # Deciding one review makes room for exactly one held job.
    status, _h, answer = wf.api.call("POST", f"/v1/jobs/{reviewing[0]}/review",
                                     {"decision": "approve"})
    assert status == 200, answer
    assert wf.wait_status(reviewing[0], "completed", "dead_letter")["status"] == "completed"
    resumed = wait_for(
        lambda: [i for i in held if wf.job(i)["status"] == "awaiting_review"] or None,
        timeout=60, what="a held job to run into review once a review was decided")
    assert len(resumed) == 1
    job = wf.job(resumed[0])
    assert [e["detail"] for e in job["events"] if e["type"] == "resumed"
            and e["detail"]["reason"] != "fair_share"] == [{"reason": "review_cap"}]
    still = [i for i in held if i != resumed[0]]
    # The pool is at its cap again (the release pass counted the job it let go against
    # the cap until it reached review): the other stays held.
    assert _held(wf.job(still[0]))
    assert wf.attempts(still[0]) == {}

    # Removing the cap lets every held job go.
    wf.sql("DELETE FROM review_caps WHERE pool = %s RETURNING pool", POOL)
    assert wf.wait_status(still[0], "awaiting_review", "completed",
                          "dead_letter")["status"] == "awaiting_review"
    for job_id in ids:
        wf.api.call("POST", f"/v1/jobs/{job_id}/review", {"decision": "approve"})


def test_a_job_admitted_before_the_cap_is_reached_is_not_held_at_its_next_step(
        wf: WorkflowEnv) -> None:
    # The race the cap must not lose: a job claimed while there was room finishes its first
    # step and is queued for the next while newer jobs are claimed. It was admitted: it
    # counts against the cap and goes on to its review; only a job never claimed waits.
    _workers(wf)
    job_id, pending = (wf.submit(WORKFLOW, {"text": INVOICE, "mode": "low_confidence"})
                       for _ in range(2))
    for i in (job_id, pending):  # pending keeps the pool's count of used reviews above 0
        assert wf.wait_status(i, "awaiting_review", "completed",
                              "dead_letter")["status"] == "awaiting_review"
    hold = queries()["hold_for_review_cap"]
    workflows = [WORKFLOW]
    with psycopg.connect(wf.db, row_factory=dict_row) as conn:  # rolled back at the end
        # Between its two steps: queued again at the second, with the claim's lease version.
        conn.execute("UPDATE jobs SET status = 'queued', step = 'extract_fields' "
                     "WHERE id = %s", (job_id,))
        used = conn.execute(
            "SELECT count(*)::int AS n FROM jobs WHERE pool = %s AND id <> %s AND "
            "(status = 'awaiting_review' OR (status IN ('running', 'queued', 'retrying') "
            "AND lease_version > 0 AND workflow = ANY(%s)))",
            (POOL, job_id, workflows)).fetchone()["n"]  # type: ignore[index]
        conn.execute("INSERT INTO review_caps (pool, cap, updated_by) VALUES (%s, %s, 'test') "
                     "ON CONFLICT (pool) DO UPDATE SET cap = EXCLUDED.cap", (POOL, used))
        assert conn.execute(hold, {"ids": [job_id], "workflows": workflows}).fetchall() == []
        # The same job had it never been claimed: past the cap, it waits.
        conn.execute("UPDATE jobs SET lease_version = 0 WHERE id = %s", (job_id,))
        held = conn.execute(hold, {"ids": [job_id], "workflows": workflows}).fetchall()
        assert [str(r["id"]) for r in held] == [job_id]
        conn.rollback()
    for i in (job_id, pending):
        wf.api.call("POST", f"/v1/jobs/{i}/review", {"decision": "approve"})
