"""Child jobs and the durable join on the real stack (issue 43): a step starts children
(``ctx.spawn``), the parent waits in ``queued`` (waiting_reason ``children``) with no lease,
and the join, decided in the transaction that settles the child it needs, resumes the
parent's next step with the children's outcomes in input order, or fails it at once naming
the failed children. Cancelling or deleting the parent reaches its children; a redrive of a
parent re-runs only its failed children. The children's model calls are counted at the
fake provider."""

from __future__ import annotations

import tempfile
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, TopicPartition
from psycopg.rows import DictRow, dict_row
from psycopg.types.json import Jsonb

from calmq import topics
from calmq.codec import decode_message, make_codec
from calmq.errors import NotFound
from calmq.tooling.devstack import StackState
from tests.support.api import Api, console_session
from tests.support.fanout_workflows import NAME, POOL, TWICE
from tests.support.waiting import wait_for
from tests.support.workers import (
    Procs,
    create_pool_topics,
    create_tenant_id,
    fake_stats,
)

pytestmark = pytest.mark.integration

TERMINAL = ("completed", "dead_letter", "cancelled")
# The worker's children_in_flight_max: a parent's children past it wait for earlier ones.
IN_FLIGHT = 3


@dataclass
class Fanout:
    api: Api
    db: str
    provider: str
    bootstrap: str
    registry: str


@pytest.fixture(scope="module")
def fanout(stack: StackState) -> Iterator[Fanout]:
    """An API and a worker that load the fan-out workflows, on the stack's fake provider
    (its calls are counted per job, so a test reads its own jobs' calls)."""
    log_dir = Path(tempfile.mkdtemp(prefix="calmq-children-logs-"))
    procs = Procs(stack.env, log_dir)
    url = stack.env["CALMQ_FAKE_PROVIDER_URL"]
    try:
        create_pool_topics(stack.env["CALMQ_KAFKA_BOOTSTRAP"], POOL, ["1s"], partitions=4)
        settings = {"workflow_modules": "tests.support.fanout_workflows",
                    "provider_url": url, "retry_tiers": "1s"}
        # The API's limit too: a redrive of a parent queues its failed children under it.
        api = procs.api(**settings, children_in_flight_max=str(IN_FLIGHT))
        procs.worker(POOL, concurrency="32", workflow_modules=settings["workflow_modules"],
                     provider_url=url, retry_tiers="1s",
                     children_in_flight_max=str(IN_FLIGHT))
        db = stack.env["CALMQ_DATABASE_URL"]
        _tenant, key = create_tenant_id(db, f"fanout-{uuid.uuid4().hex[:8]}")
        yield Fanout(Api(api, key), db, url, stack.env["CALMQ_KAFKA_BOOTSTRAP"],
                     stack.env.get("CALMQ_SCHEMA_REGISTRY_URL", ""))
    finally:
        procs.stop_all()


def _submit(f: Fanout, **input_: Any) -> str:
    status, _h, body = f.api.call("POST", "/v1/jobs", {"workflow": NAME, "input": input_})
    assert status == 202, body
    return str(body["job_id"])


def _finished(f: Fanout, job_id: str, timeout: float = 90) -> dict[str, Any]:
    return dict(wait_for(lambda: (j := f.api.job(job_id))["status"] in TERMINAL and j,
                         timeout=timeout, what=f"job {job_id} to finish"))


def _rows(f: Fanout, sql: str, *args: Any) -> list[dict[str, Any]]:
    with psycopg.connect(f.db, row_factory=dict_row) as conn:
        return conn.execute(sql, args).fetchall()


def _children(f: Fanout, parent: str) -> list[dict[str, Any]]:
    return _rows(f, "SELECT id::text AS id, child_index, status, updated_at FROM jobs"
                    " WHERE parent_id = %s ORDER BY child_index", parent)


def _events(f: Fanout, job_id: str) -> list[dict[str, Any]]:
    return _rows(f, "SELECT type, detail FROM job_events WHERE job_id = %s ORDER BY id", job_id)


def _artifact(f: Fanout, job_id: str) -> dict[str, Any]:
    status, _h, body = f.api.call("GET", f"/v1/jobs/{job_id}/artifact")
    assert status == 200, body
    return dict(body)


def test_all_join_resumes_the_parent_once_with_outputs_in_input_order(fanout: Fanout) -> None:
    """An all join resumes the parent's next step once, with the children in input order."""
    texts = [f"child text number {i}" for i in range(6)]
    parent = _submit(fanout, texts=texts)
    job = _finished(fanout, parent)
    assert job["status"] == "completed", job
    kids = _children(fanout, parent)
    assert [k["child_index"] for k in kids] == list(range(6))
    assert {k["status"] for k in kids} == {"completed"}
    got = _artifact(fanout, parent)
    assert got["asked"] == 6
    assert [c["job_id"] for c in got["children"]] == [k["id"] for k in kids]
    assert all(c["status"] == "completed" and c["summary"] for c in got["children"])
    types = [e["type"] for e in _events(fanout, parent)]
    assert types.count("children_spawned") == 1
    assert types.count("children_joined") == 1
    assert types.index("children_spawned") < types.index("children_joined")
    joins = _rows(fanout, "SELECT succeeded, failed, fired_at, outcome FROM job_joins"
                          " WHERE parent_id = %s", parent)
    assert len(joins) == 1
    assert joins[0]["succeeded"] == 6
    assert joins[0]["outcome"] == "resumed"
    # Each child is an ordinary job of the parent's tenant with its own single paid call.
    by_job = fake_stats(fanout.provider)["by_job"]
    assert [by_job[k["id"]]["calls"] for k in kids] == [1] * 6


def test_a_failed_child_fails_an_all_join_at_once_naming_it(fanout: Fanout) -> None:
    """A dead-lettered child fails an all join at once, naming it, while its siblings run on."""
    parent = _submit(fanout, texts=["slow a", "bad", "slow b"],
                     modes=["success", "malformed", "success"], delays=[20_000, 0, 20_000])
    job = _finished(fanout, parent, timeout=15)  # well before the slow siblings could answer
    assert job["status"] == "dead_letter", job
    assert job["error"]["code"] == "children_failed"
    kids = _children(fanout, parent)
    bad = kids[1]
    assert bad["status"] == "dead_letter"
    assert bad["id"] in job["error"]["message"]
    # Decided in the transaction that settled the failed child: the same now().
    parent_at = _rows(fanout, "SELECT updated_at FROM jobs WHERE id = %s", parent)[0]
    assert parent_at["updated_at"] == bad["updated_at"]
    # Left to finish (a redrive keeps their outputs), not cancelled with the parent.
    assert kids[0]["status"] not in TERMINAL
    assert kids[2]["status"] not in TERMINAL
    dead = [e for e in _events(fanout, parent) if e["type"] == "dead_lettered"]
    assert len(dead) == 1
    assert dead[0]["detail"]["failed_children"] == [bad["id"]]


def test_at_least_k_resumes_when_k_succeeded(fanout: Fanout) -> None:
    """A join of at least k of n resumes the parent once k children succeeded, one failing."""
    parent = _submit(fanout, texts=["a", "b", "c", "d"],
                     modes=["success", "malformed", "success", "success"],
                     join="at_least", k=3)
    job = _finished(fanout, parent)
    assert job["status"] == "completed", job
    got = _artifact(fanout, parent)
    statuses = [c["status"] for c in got["children"]]
    assert statuses.count("completed") >= 3


def test_at_least_k_fails_once_k_can_no_longer_succeed(fanout: Fanout) -> None:
    """A join of at least k fails the parent as soon as too many children failed for k to hold."""
    parent = _submit(fanout, texts=["a", "b", "c"], modes=["malformed", "malformed", "success"],
                     join="at_least", k=2)
    job = _finished(fanout, parent)
    assert job["status"] == "dead_letter", job
    assert job["error"]["code"] == "children_failed"
    kids = _children(fanout, parent)
    failed = [k["id"] for k in kids if k["status"] == "dead_letter"]
    assert len(failed) == 2
    assert all(i in job["error"]["message"] for i in failed)


def test_all_finish_lists_the_failed_children(fanout: Fanout) -> None:
    """A join of all_finish resumes once every child ended, the failed ones listed in order."""
    parent = _submit(fanout, texts=["a", "b", "c"], modes=["success", "malformed", "success"],
                     join="all_finish")
    job = _finished(fanout, parent)
    assert job["status"] == "completed", job
    got = _artifact(fanout, parent)
    assert [c["status"] for c in got["children"]] == ["completed", "dead_letter", "completed"]
    assert got["children"][1]["summary"] is None
    kids = _children(fanout, parent)
    joined = [e for e in _events(fanout, parent) if e["type"] == "children_joined"]
    assert len(joined) == 1
    assert joined[0]["detail"]["failed_children"] == [kids[1]["id"]]


def test_the_waiting_parent_holds_no_lease(fanout: Fanout) -> None:
    """While its children run, the parent is queued with waiting_reason children and no lease."""
    parent = _submit(fanout, texts=["a", "b"], delays=[3_000, 3_000])
    row = wait_for(lambda: (r := _rows(fanout, "SELECT status, waiting_reason, lease_owner"
                                                " FROM jobs WHERE id = %s", parent))
                   and r[0]["waiting_reason"] == "children" and r[0],
                   timeout=30, what="the parent to wait for its children")
    assert row["status"] == "queued"
    assert row["lease_owner"] is None
    assert f"{fanout.api.job(parent)['status']}" == "queued"
    assert _finished(fanout, parent)["status"] == "completed"


def test_cancelling_the_parent_cancels_its_children(fanout: Fanout) -> None:
    """Cancelling a parent that waits for its children cancels every child not yet ended,
    and each child's job.result (status cancelled) reaches the results topic, as the
    parent's does: a consumer of results sees every child end."""
    parent = _submit(fanout, texts=["a", "b", "c"], delays=[20_000] * 3)
    wait_for(lambda: len(_children(fanout, parent)) == 3, timeout=30,
             what="the children to start")
    consumer = _results_consumer(fanout)
    try:
        status, _h, body = fanout.api.call("POST", f"/v1/jobs/{parent}/cancel")
        assert status == 200, body
        kids = _children(fanout, parent)
        assert {k["status"] for k in kids} == {"cancelled"}
        for kid in kids:
            assert any(e["type"] == "cancelled" and e["detail"].get("by") == "parent"
                       for e in _events(fanout, kid["id"]))
        wanted = {parent, *(k["id"] for k in kids)}
        results: dict[str, dict[str, Any]] = {}
        wait_for(lambda: _read_results(fanout, consumer, wanted, results) >= wanted,
                 timeout=60, what="a job.result for the parent and each of its children")
    finally:
        consumer.close()
    assert {i: r["status"] for i, r in results.items()} == dict.fromkeys(wanted, "cancelled")
    assert {str(results[k["id"]]["parent_id"]) for k in kids} == {parent}


def _results_consumer(f: Fanout) -> Consumer:
    """A consumer of the results topic from its current end."""
    consumer = Consumer({"bootstrap.servers": f.bootstrap, "enable.auto.commit": False,
                         "group.id": f"children-results-{uuid.uuid4().hex[:8]}"})
    name = topics.topic_for_route(topics.RESULTS_ROUTE)
    ends = []
    for p in consumer.list_topics(name, timeout=10).topics[name].partitions:
        _low, high = consumer.get_watermark_offsets(TopicPartition(name, p), timeout=10)
        ends.append(TopicPartition(name, p, high))
    consumer.assign(ends)
    return consumer


def _read_results(f: Fanout, consumer: Consumer, wanted: set[str],
                  found: dict[str, dict[str, Any]]) -> set[str]:
    """Read what is there; keep the job.result events of ``wanted`` jobs by job id."""
    codec = make_codec(f.registry)
    for msg in consumer.consume(500, timeout=1):
        if msg.error() or msg.key() is None or msg.key().decode() not in wanted:
            continue
        kind, event = decode_message(codec, msg.value(), None)
        if kind == "job.result":
            found[str(event["job_id"])] = event  # a uuid in the schema
    return set(found)


def test_redriving_the_parent_reruns_only_its_failed_children(fanout: Fanout) -> None:
    """Redriving a parent whose join failed re-runs only its failed child, counted at the fake."""
    parent = _submit(fanout, texts=["a", "b", "c"], modes=["success", "flaky", "success"])
    job = _finished(fanout, parent)
    assert job["status"] == "dead_letter", job
    kids = _children(fanout, parent)
    assert [k["status"] for k in kids] == ["completed", "dead_letter", "completed"]
    status, _h, body = fanout.api.call("POST", f"/v1/dead-letters/{parent}/redrive",
                                       {"reason": "the provider is back"})
    assert status == 200, body
    job = _finished(fanout, parent)
    assert job["status"] == "completed", job
    got = _artifact(fanout, parent)
    assert [c["status"] for c in got["children"]] == ["completed"] * 3
    by_job = fake_stats(fanout.provider)["by_job"]
    # The flaky child's first call failed; the redrive's is its second.
    assert [by_job[k["id"]]["calls"] for k in kids] == [1, 2, 1]
    types = [e["type"] for e in _events(fanout, parent)]
    assert types.count("children_joined") == 1
    assert types.count("children_spawned") == 1


def test_a_redriven_parent_keeps_its_failed_children_under_the_in_flight_limit(
        fanout: Fanout) -> None:
    """Redriving a parent with more failed children than children_in_flight_max queues at
    most that many at once (the rest wait, parent_in_flight, and go as earlier ones end),
    and every child ends completed."""
    n = 3 * IN_FLIGHT + 1
    parent = _submit(fanout, texts=[f"again {i}" for i in range(n)], modes=["flaky"] * n,
                     delays=[400] * n)
    assert _finished(fanout, parent)["status"] == "dead_letter"
    wait_for(lambda: [k["status"] for k in _children(fanout, parent)] == ["dead_letter"] * n,
             timeout=90, what="every child to fail (each after its first call)")
    redriven_at = _rows(fanout, "SELECT now() AS at")[0]["at"]
    status, _h, body = fanout.api.call("POST", f"/v1/dead-letters/{parent}/redrive",
                                       {"reason": "the provider is back"})
    assert status == 200, body
    samples: list[dict[str, Any]] = []

    def sample() -> bool:
        row = _rows(fanout, (
            "SELECT count(*) FILTER (WHERE status IN ('queued', 'running', 'retrying')"
            "                        AND waiting_reason IS DISTINCT FROM 'parent_in_flight')"
            "         AS in_flight,"
            "       count(*) FILTER (WHERE waiting_reason = 'parent_in_flight') AS held,"
            "       count(*) FILTER (WHERE status = 'completed') AS completed,"
            "       (SELECT count(*) FROM job_held_children h WHERE h.parent_id = %s) AS rows"
            " FROM jobs WHERE parent_id = %s"), parent, parent)[0]
        samples.append(row)
        return bool(row["completed"] == n)

    wait_for(sample, timeout=120,
             what="every redriven child to complete, never more than the limit in flight")
    assert max(s["in_flight"] for s in samples) <= IN_FLIGHT, samples
    # The first look, right after the redrive: the children past the limit waited.
    assert samples[0]["held"] >= n - IN_FLIGHT - 1, samples[0]
    assert samples[0]["rows"] == samples[0]["held"], samples[0]
    assert _finished(fanout, parent)["status"] == "completed"
    assert _rows(fanout, "SELECT count(*) AS n FROM job_held_children WHERE parent_id = %s",
                 parent)[0]["n"] == 0
    # The same from the attempts of the redrive's round: never more than the limit at once.
    spans = _rows(fanout, "SELECT a.started_at, a.finished_at FROM job_attempts a"
                          " JOIN jobs j ON j.id = a.job_id"
                          " WHERE j.parent_id = %s AND a.started_at >= %s", parent, redriven_at)
    assert len(spans) == n
    edges = sorted([(r["started_at"], 1) for r in spans]
                   + [(r["finished_at"], -1) for r in spans], key=lambda e: (e[0], e[1]))
    now = most = 0
    for _at, step in edges:
        now += step
        most = max(most, now)
    assert most <= IN_FLIGHT
    by_job = fake_stats(fanout.provider)["by_job"]
    assert [by_job[k["id"]]["calls"] for k in _children(fanout, parent)] == [2] * n


def test_the_api_pages_through_a_jobs_children_and_each_names_its_parent(fanout: Fanout) -> None:
    """GET /v1/jobs/{id}/children pages the children in input order with counts by status."""
    parent = _submit(fanout, texts=[f"t{i}" for i in range(5)])
    assert _finished(fanout, parent)["status"] == "completed"
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        path = f"/v1/jobs/{parent}/children?limit=2" + (f"&cursor={cursor}" if cursor else "")
        status, _h, page = fanout.api.call("GET", path)
        assert status == 200, page
        assert page["counts"] == {"completed": 5}
        assert page["total"] == 5
        assert page["parent_id"] is None
        assert page["joins"][0]["outcome"] == "resumed"
        seen += [c["job_id"] for c in page["children"]]
        pages += 1
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert pages == 3
    kids = _children(fanout, parent)
    assert seen == [k["id"] for k in kids]
    assert fanout.api.job(kids[0]["id"])["parent_id"] == parent
    assert fanout.api.job(parent)["parent_id"] is None
    status, _h, _body = fanout.api.call("GET", f"/v1/jobs/{uuid.uuid4()}/children")
    assert status == 404
    # The console's job page shows the tree: the children counted by status, each linked,
    # and on a child's page its parent.
    cookie = console_session(fanout.api.base_url, fanout.api.key)
    page = _console(fanout, cookie, parent)
    assert 'data-testid="children-counts">5 children:' in page
    assert all(f'href="/console/jobs/{k["id"]}"' in page for k in kids)
    assert f'href="/console/jobs/{parent}"' in _console(fanout, cookie, kids[0]["id"])


def _console(f: Fanout, cookie: str, job_id: str) -> str:
    req = urllib.request.Request(f"{f.api.base_url}/console/jobs/{job_id}",
                                 headers={"Cookie": f"calmq_console={cookie}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return str(resp.read().decode())


def test_deleting_the_parent_cancels_and_purges_its_children(fanout: Fanout) -> None:
    """DELETE of a parent cancels its children still running and purges every child too."""
    parent = _submit(fanout, texts=["a", "b", "c"], modes=["success", "malformed", "success"],
                     delays=[0, 0, 20_000])
    assert _finished(fanout, parent)["status"] == "dead_letter"
    kids = _children(fanout, parent)
    wait_for(lambda: _children(fanout, parent)[0]["status"] == "completed", timeout=30,
             what="the first child to complete")
    assert _children(fanout, parent)[2]["status"] not in TERMINAL
    status, _h, body = fanout.api.call("DELETE", f"/v1/jobs/{parent}")
    assert status == 204, body
    rows = {r["id"]: r for r in _rows(
        fanout, "SELECT id::text AS id, status, redacted_at, artifact FROM jobs"
                " WHERE id = ANY(%s::uuid[])", [parent, *(k["id"] for k in kids)])}
    assert [rows[k["id"]]["status"] for k in kids] == ["completed", "dead_letter", "cancelled"]
    assert all(r["redacted_at"] is not None for r in rows.values())
    status, _h, _body = fanout.api.call("GET", f"/v1/jobs/{kids[0]['id']}/artifact")
    assert status == 404


def test_children_past_the_in_flight_limit_wait_for_earlier_ones(fanout: Fanout) -> None:
    """At most children_in_flight_max of a parent's children run at once; the rest wait."""
    parent = _submit(fanout, texts=[f"t{i}" for i in range(8)], delays=[1_000] * 8)
    held = wait_for(lambda: (r := _rows(
        fanout, "SELECT count(*) FILTER (WHERE waiting_reason = 'parent_in_flight') AS n,"
                " count(*) AS total FROM jobs WHERE parent_id = %s", parent)[0])["total"] == 8
        and r, timeout=30, what="the children to be written")
    assert held["n"] >= 8 - IN_FLIGHT - 1  # one may have ended and released the next already
    assert _finished(fanout, parent)["status"] == "completed"
    spans = _rows(fanout, "SELECT a.started_at, a.finished_at FROM job_attempts a"
                          " JOIN jobs j ON j.id = a.job_id WHERE j.parent_id = %s", parent)
    assert len(spans) == 8
    edges = sorted([(r["started_at"], 1) for r in spans]
                   + [(r["finished_at"], -1) for r in spans], key=lambda e: (e[0], e[1]))
    now = most = 0
    for _at, step in edges:
        now += step
        most = max(most, now)
    assert most <= IN_FLIGHT
    assert _rows(fanout, "SELECT count(*) AS n FROM job_held_children WHERE parent_id = %s",
                 parent)[0]["n"] == 0


def test_a_job_that_spawns_twice_joins_each_steps_own_children(fanout: Fanout) -> None:
    """A job whose two steps each start children gives each next step its own children."""
    status, _h, body = fanout.api.call("POST", "/v1/jobs", {
        "workflow": TWICE, "input": {"texts": ["a", "b"]}})
    assert status == 202, body
    parent = str(body["job_id"])
    assert _finished(fanout, parent)["status"] == "completed"
    assert _artifact(fanout, parent) == {"first": [0, 1], "second": [0, 1, 2]}
    assert [k["child_index"] for k in _children(fanout, parent)] == [0, 1, 2, 3, 4]
    joined = [e for e in _events(fanout, parent) if e["type"] == "children_joined"]
    assert [(e["detail"]["step"], e["detail"]["children"]) for e in joined] == [
        ("split", 2), ("again", 3)]


def _join_with_children(conn: psycopg.Connection[Any], n: int, held: int) -> tuple[
        uuid.UUID, list[uuid.UUID]]:
    """A parent waiting for an all join of ``n`` running children, the last ``held`` of
    them held for the in-flight limit (rows only: the caller rolls them back)."""
    tenant, parent = uuid.uuid4(), uuid.uuid4()
    kids = [uuid.uuid4() for _ in range(n)]
    conn.execute("INSERT INTO tenants (id, name) VALUES (%s, %s)",
                 (tenant, f"join-rows-{tenant.hex[:12]}"))
    job = ("INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority,"
           " pool, step, max_attempts, input, waiting_reason, parent_id, child_index,"
           " parent_step) VALUES (%s, %s, 'summarize', 1, %s, 'bulk', 'default', 's', 3,"
           " '{}', %s, %s, %s, %s)")
    conn.execute(job, (parent, tenant, "queued", "children", None, None, None))
    for index, kid in enumerate(kids):
        waits = index >= n - held
        conn.execute(job, (kid, tenant, "queued" if waits else "running",
                           "parent_in_flight" if waits else None, parent, index, "split"))
        if waits:
            conn.execute("INSERT INTO job_held_children (job_id, parent_id, child_index, route,"
                         " payload) VALUES (%s, %s, %s, 'calmq.default.bulk', '{}')",
                         (kid, parent, index))
    conn.execute("INSERT INTO job_joins (parent_id, step, policy, k, n, resume_outbox,"
                 " fail_outbox) VALUES (%s, 'split', 'all', %s, %s, %s, '[]')",
                 (parent, n, n, Jsonb([{"route": "calmq.default.bulk", "type": "job.requested",
                                        "payload": {}}])))
    return parent, kids


def test_a_statement_settling_many_children_updates_each_join_row_once(
        stack_env: dict[str, str]) -> None:
    """A statement settling many children of two parents updates each join row once, releases
    as many held children in input order, and the last one resumes each parent once."""
    n, held = 40, 10
    with psycopg.connect(stack_env["CALMQ_DATABASE_URL"], row_factory=dict_row) as conn, \
            conn.transaction(force_rollback=True):
        (a, kids_a), (b, kids_b) = (_join_with_children(conn, n, held) for _ in range(2))

        def join_updates() -> int:
            row = conn.execute("SELECT pg_stat_get_xact_tuples_updated("
                               "'job_joins'::regclass) AS n").fetchone()
            assert row is not None
            return int(row["n"])

        before = join_updates()
        # As a group commit does: children of both parents end in one statement.
        conn.execute("UPDATE jobs SET status = 'completed' WHERE id = ANY(%s)",
                     (kids_a[:4] + kids_b[:25],))
        assert join_updates() - before == 2  # 29 children, two join rows
        counts = {r["parent_id"]: r["succeeded"] for r in conn.execute(
            "SELECT parent_id, succeeded FROM job_joins WHERE parent_id IN (%s, %s)", (a, b))}
        assert counts == {a: 4, b: 25}
        # Four ended of a: its first four held children (input order) go, with their events.
        left = conn.execute("SELECT child_index FROM job_held_children WHERE parent_id = %s"
                            " ORDER BY child_index", (a,)).fetchall()
        assert [r["child_index"] for r in left] == list(range(n - held + 4, n))
        freed = conn.execute("SELECT child_index FROM jobs WHERE parent_id = %s"
                             " AND status = 'queued' AND waiting_reason IS NULL"
                             " ORDER BY child_index", (a,)).fetchall()
        assert [r["child_index"] for r in freed] == list(range(n - held, n - held + 4))
        released = conn.execute("SELECT count(*) AS n FROM outbox WHERE type = 'job.requested'"
                                " AND aggregateid = ANY(%s)",
                                ([str(k) for k in kids_a[n - held:]],)).fetchone()
        assert released == {"n": 4}
        assert conn.execute("SELECT count(*) AS n FROM job_held_children WHERE parent_id = %s",
                            (b,)).fetchone() == {"n": 0}

        before = join_updates()
        conn.execute("UPDATE jobs SET status = 'completed' WHERE parent_id IN (%s, %s)"
                     " AND status <> 'completed'", (a, b))
        assert join_updates() - before == 2  # counted and decided in one UPDATE each
        for parent in (a, b):
            joined = conn.execute("SELECT detail FROM job_events WHERE job_id = %s"
                                  " AND type = 'children_joined'", (parent,)).fetchall()
            assert [r["detail"]["succeeded"] for r in joined] == [n]
            row = conn.execute("SELECT waiting_reason FROM jobs WHERE id = %s",
                               (parent,)).fetchone()
            assert row == {"waiting_reason": None}
            resumed = conn.execute("SELECT count(*) AS n FROM outbox WHERE aggregateid = %s",
                                   (str(parent),)).fetchone()
            assert resumed == {"n": 1}


class _CountedCursor(psycopg.AsyncCursor[DictRow]):
    """A cursor that counts the statements sent through it (the driver's, instrumented)."""

    sent = 0

    async def execute(self, query: Any, params: Any = None, **kwargs: Any) -> Any:
        _CountedCursor.sent += 1
        return await super().execute(query, params, **kwargs)

    async def executemany(self, query: Any, params_seq: Any, **kwargs: Any) -> None:
        rows = list(params_seq)
        _CountedCursor.sent += len(rows)
        await super().executemany(query, rows, **kwargs)


class _CountedConnection(psycopg.AsyncConnection[DictRow]):
    """A connection that counts the transactions opened on it."""

    opened = 0

    def transaction(self, *args: Any, **kwargs: Any) -> Any:
        _CountedConnection.opened += 1
        return super().transaction(*args, **kwargs)


def _family(conn: psycopg.Connection[Any], tenant: uuid.UUID, n: int, running: int,
            held: int) -> tuple[uuid.UUID, list[uuid.UUID]]:
    """A dead-lettered parent with ``n`` children: the last ``running`` + ``held`` of them
    not ended (the held ones waiting for the in-flight limit), the others completed; each
    with an input, metadata, a step output and a history event."""
    parent = uuid.uuid4()
    kids = [uuid.uuid4() for _ in range(n)]
    job = ("INSERT INTO jobs (id, tenant_id, workflow, workflow_version, status, priority,"
           " pool, step, max_attempts, input, metadata, waiting_reason, parent_id,"
           " child_index, parent_step) VALUES (%s, %s, 'summarize', 1, %s, 'bulk',"
           " 'default', 's', 1, %s, '{\"tag\": \"purge\"}', %s, %s, %s, %s)")
    conn.execute(job, (parent, tenant, "dead_letter", Jsonb({"texts": ["x"]}), None, None,
                       None, None))
    with conn.cursor() as cur:
        cur.executemany(job, [
            (kid, tenant, "completed" if i < n - running - held
             else "running" if i < n - held else "queued", Jsonb({"text": f"secret {i}"}),
             "parent_in_flight" if i >= n - held else None, parent, i, "split")
            for i, kid in enumerate(kids)])
        cur.executemany("INSERT INTO step_outputs (job_id, step, state, output)"
                        " VALUES (%s, 's', 'done', %s)",
                        [(kid, Jsonb({"summary": "secret"})) for kid in kids])
        cur.executemany("INSERT INTO job_events (job_id, type, attempt, detail)"
                        " VALUES (%s, 'queued', 0, %s)",
                        [(kid, Jsonb({"said": "secret"})) for kid in kids])
        cur.executemany("INSERT INTO job_held_children (job_id, parent_id, child_index, route,"
                        " payload) VALUES (%s, %s, %s, 'calmq.default.bulk', '{}')",
                        [(kids[i], parent, i) for i in range(n - held, n)])
    return parent, kids


async def _counted_purge(url: str, objects_url: str, tenant: uuid.UUID, parent: uuid.UUID
                         ) -> tuple[int, int]:
    """Purge ``parent`` as DELETE /v1/jobs/{id} does; the statements and transactions sent."""
    from psycopg_pool import AsyncConnectionPool

    from calmq.data import Database
    from calmq.objects import open_object_store
    from calmq.producers.retention import purge
    from calmq.settings import Settings

    db = Database(url)
    db.pool = AsyncConnectionPool(url, connection_class=_CountedConnection, min_size=1,
                                  max_size=2, open=False,
                                  kwargs={"autocommit": True, "row_factory": dict_row,
                                          "cursor_factory": _CountedCursor})
    await db.open()
    try:
        sent, opened = _CountedCursor.sent, _CountedConnection.opened
        await purge(db, open_object_store(objects_url),
                    Settings(database_url=url, object_store_url=objects_url), tenant, parent)
        return _CountedCursor.sent - sent, _CountedConnection.opened - opened
    finally:
        await db.close()


def test_deleting_a_parent_purges_its_children_set_based(fanout: Fanout,
                                                         stack: StackState) -> None:
    """Purging a parent of 500 children takes as many statements and transactions as one of
    20 (a statement per table for the batch, not a purge per child): every child redacted,
    its objects deleted, those not ended cancelled with their job.result sent, no held or
    unpublished row left."""
    import asyncio

    from calmq.objects import open_object_store
    from calmq.workflows.progress import artifact_key

    objects_url = stack.env["CALMQ_OBJECT_STORE_URL"]
    store = open_object_store(objects_url)
    costs = []
    for n in (20, 500):
        tenant = create_tenant_id(fanout.db, f"purge-{uuid.uuid4().hex[:8]}")[0]
        with psycopg.connect(fanout.db, row_factory=dict_row, autocommit=True) as conn:
            parent, kids = _family(conn, tenant, n, running=5, held=3)
        refs = asyncio.run(_put_all(store, [artifact_key(tenant, k, "s") for k in kids]))
        consumer = _results_consumer(fanout)
        try:
            costs.append(asyncio.run(_counted_purge(fanout.db, objects_url, tenant, parent)))
            ended = {str(k) for k in kids[n - 8:]}
            found: dict[str, dict[str, Any]] = {}
            wait_for(lambda c=consumer, e=ended, f=found: _read_results(fanout, c, e, f) >= e,
                     timeout=60, what="a job.result for each child the delete cancelled")
        finally:
            consumer.close()
        assert {r["status"] for r in found.values()} == {"cancelled"}
        rows = _rows(fanout, "SELECT id, status, input, metadata, redacted_at FROM jobs"
                             " WHERE parent_id = %s OR id = %s", parent, parent)
        assert len(rows) == n + 1
        assert all(r["redacted_at"] is not None and r["input"] is None
                   and r["metadata"] == {} for r in rows)
        statuses = {r["id"]: r["status"] for r in rows}
        assert [statuses[k] for k in kids[n - 8:]] == ["cancelled"] * 8
        assert [statuses[k] for k in kids[:n - 8]] == ["completed"] * (n - 8)
        left = _rows(fanout, (
            "SELECT (SELECT count(*) FROM job_held_children WHERE parent_id = %s) AS held,"
            " (SELECT count(*) FROM outbox WHERE aggregateid = ANY(%s::text[])) AS outbox,"
            " (SELECT count(*) FROM step_outputs WHERE job_id = ANY(%s::uuid[])"
            "   AND output <> '{}') AS outputs,"
            " (SELECT count(*) FROM job_events WHERE job_id = ANY(%s::uuid[])"
            "   AND detail <> '{}') AS events,"
            " (SELECT count(*) FROM job_events WHERE job_id = ANY(%s::uuid[])"
            "   AND type = 'cancelled') AS cancelled"),
            parent, [str(k) for k in kids], kids, kids, kids)[0]
        assert left == {"held": 0, "outbox": 0, "outputs": 0, "events": 0, "cancelled": 8}
        assert not any(asyncio.run(_exist(store, refs)))
    # Bounded: the same work for 500 children as for 20.
    assert costs[0] == costs[1], costs
    statements, transactions = costs[1]
    assert statements <= 45, costs
    assert transactions <= 3, costs


async def _put_all(store: Any, keys: list[str]) -> list[str]:
    return [(await store.put(key, b"{}", "application/json")).uri for key in keys]


async def _exist(store: Any, uris: list[str]) -> list[bool]:
    found = []
    for uri in uris:
        try:
            await store.get(uri)
            found.append(True)
        except NotFound:
            found.append(False)
    return found
