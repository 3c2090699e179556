"""The fault matrix: jobs of mixed modes flow through the whole pipeline while, in turn, each
part fails, and after each fault nothing is stuck, lost, completed twice or overwritten.

One stack of the module's own (tests/support/chaos.py) serves every fault kind in order;
each fault gets a tenant of its own, so its checks see exactly its jobs. A fault is injected
at a random moment of a paced load (posted through the API with an Idempotency-Key, re-posted
until accepted, as a careful client does), then lifted. The backlog has drained when every
job settled, its result is on calmq.results and every partition's committed offset is at its
log end; the recovery time runs until then from the later of the fault's end (the killed
process serving again, the broker or database back, the outage over) and the last job
accepted (the backlog cannot drain while jobs still arrive).

After each fault the test asserts:
- every job the load posted was accepted once, and the tenant has exactly those jobs (none
  lost, none written twice);
- every job is terminal, or waiting for review (only ``low_confidence`` jobs may);
- a job's history holds one ending event (``completed``/``dead_lettered``/``cancelled``),
  and ``completed`` once for a completed job, never for another;
- calmq.results may hold a job's result more than once (at-least-once), but every copy
  carries the same outcome: the job's status, artifact digest and artifact URI; a job under
  review has none;
- a completed job's stored artifact has the sha256 the job and its result event report;
- no job was dead-lettered as a ``bug`` (an infrastructure fault is not the job's fault);
- the consumer groups of the work topics (workers) and retry tiers (forwarder) committed up
  to the log end of every partition, and every calmq process is still running.

`make test` runs a reduced form (30 jobs per fault, 270 in all, 5 s outages);
`make chaos` (CALMQ_CHAOS_FULL=1) the full one: 2,000 jobs, 20 s outages, and first
``no_fault``, the same load with nothing failing: the baseline the recovery times compare
with (retries, timeouts and review take their time even on a good day).
"""

from __future__ import annotations

import os
import random
import shutil
import socket
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from calmq.tooling.devstack import processes
from tests.support.chaos import (
    SETTLED,
    ChaosStack,
    Load,
    Results,
    lagging_partitions,
    new_tenant,
    object_digest,
    rows_of,
)
from tests.support.waiting import wait_for

pytestmark = pytest.mark.chaos

FULL = os.environ.get("CALMQ_CHAOS_FULL", "") not in ("", "0")
# The baseline only in full: the reduced form under `make test` must stay within ~4 minutes.
KINDS = ["no_fault"] * FULL + [
    "worker_kill", "forwarder_kill", "relay_kill", "api_kill", "kafka_restart",
    "postgres_restart", "registry_outage", "object_store_outage", "provider_outage"]
TOTAL_JOBS = 2000 if FULL else 270
OUTAGE_SECONDS = 20.0 if FULL else 5.0
LOAD_SECONDS = 30.0 if FULL else 5.0
SETTLE_SECONDS = 240.0 if FULL else 150.0
SEED = int(os.environ.get("CALMQ_CHAOS_SEED", str(random.randrange(10**6))))
RNG = random.Random(SEED)
SUMMARY: list[dict[str, Any]] = []


def _jobs_for(kind: str) -> int:
    share, extra = divmod(TOTAL_JOBS, len(KINDS))
    return share + (1 if KINDS.index(kind) < extra else 0)


@pytest.fixture(scope="module")
def chaos(request: pytest.FixtureRequest) -> Iterator[tuple[ChaosStack, Results]]:
    # A folder of its own, not pytest's tmp_path: pytest prunes old base folders of the same
    # user, and the services' logs must outlive the run to explain a failure.
    home = Path(tempfile.mkdtemp(prefix="calmq-chaos-"))
    try:
        stack = ChaosStack(home)
    except Exception as exc:  # noqa: BLE001 - reported the way the session stack reports it
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(f"the chaos stack could not start in CI: {exc}", pytrace=False)
        pytest.skip(f"the chaos stack could not start here: {exc}")
    results = Results(stack.bootstrap, stack.registry_url)
    try:
        yield stack, results
    finally:
        results.close()
        stack.close()
        if not os.environ.get("CALMQ_TEST_KEEP_STACK"):
            # The broker's and the database's data; the logs stay.
            shutil.rmtree(home / "stack", ignore_errors=True)
        _print_summary(request, home)


def _print_summary(request: pytest.FixtureRequest, home: Path) -> None:
    if not SUMMARY:
        return
    lines = [f"fault matrix ({'full' if FULL else 'reduced'}, seed {SEED}); drained = every job"
             " settled, its result published, offsets committed; 'after fault' counts from the"
             " fault's end, 'recovery' from the later of the fault's end and the last job"
             f" accepted (no_fault: the baseline); logs in {home / 'logs'}",
             f"{'fault':<20}{'jobs':>6}{'fault s':>9}{'after fault s':>15}{'recovery s':>12}"
             f"{'completed':>11}{'dead':>6}{'review':>8}{'requeued':>10}{'re-posts':>10}"]
    lines += [f"{r['kind']:<20}{r['jobs']:>6}{r['fault_s']:>9.1f}{r['after_fault_s']:>15.1f}"
              f"{r['recovery_s']:>12.1f}{r['completed']:>11}{r['dead_letter']:>6}"
              f"{r['awaiting_review']:>8}{r['requeued']:>10}{r['reposts']:>10}"
              for r in SUMMARY]
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    for line in lines:
        if reporter is not None:
            reporter.write_line(line)
        else:
            print(line)


def _hold(seconds: float) -> None:
    """Keep a fault in place this long: the fault's duration, not a synchronisation."""
    threading.Event().wait(seconds)


def _leases_of(db: str, pid: int | None) -> int:
    with psycopg.connect(db) as conn:
        row = conn.execute("SELECT count(*) FROM jobs WHERE status = 'running' AND "
                           "lease_owner = %s", (f"{socket.gethostname()}-{pid}",)).fetchone()
    return int(row[0]) if row else 0


def _inject(kind: str, stack: ChaosStack) -> tuple[float, float]:
    """Apply the fault and lift it; returns when it started and when it ended (monotonic)."""
    started = time.monotonic()
    services = stack.services
    if kind == "no_fault":
        pass  # the control: how long the same load takes to drain with nothing failing
    elif kind.endswith("_kill"):
        name = kind.removesuffix("_kill")
        if name == "worker":
            # Kill one while it holds leases: a worker between two batches loses nothing.
            workers = RNG.sample(["worker-1", "worker-2"], 2)
            name = wait_for(lambda: next((w for w in workers
                                          if _leases_of(stack.db, services[w].pid)), None),
                            timeout=30, what="a worker holding leases before the kill")
        started = time.monotonic()
        services[name].kill9()
        services[name].start()  # as its supervisor would: at once, and wait until it serves
    elif kind == "kafka_restart":
        start = stack.stop_kafka()
        _hold(OUTAGE_SECONDS / 2)
        start()
    elif kind == "postgres_restart":
        stack.restart_postgres()
    elif kind == "registry_outage":
        stack.registry_proxy.cut()
        # A worker that starts during the outage has no schema cached: it must wait the
        # registry out (the ones running have every schema id cached by now).
        worker = services[RNG.choice(["worker-1", "worker-2"])]
        worker.stop()
        worker.start()
        _hold(max(0.0, started + OUTAGE_SECONDS - time.monotonic()))
        stack.registry_proxy.restore()
    elif kind == "object_store_outage":
        stack.objects_proxy.cut()
        _hold(OUTAGE_SECONDS)
        stack.objects_proxy.restore()
    elif kind == "provider_outage":
        stack.provider_outage(OUTAGE_SECONDS)
        _hold(OUTAGE_SECONDS)
    else:  # pragma: no cover - KINDS and this function go together
        raise AssertionError(kind)
    return started, time.monotonic()


@pytest.mark.parametrize("kind", KINDS)
def test_fault_leaves_nothing_stuck_lost_or_doubled(
        kind: str, chaos: tuple[ChaosStack, Results]) -> None:
    """After the fault every job is settled once, its result and artifact agree, offsets move."""
    stack, results = chaos
    tenant, key = new_tenant(stack.db, kind)
    count = _jobs_for(kind)
    load = Load(stack.api_url, key, kind, count, LOAD_SECONDS).start()
    # The fault begins at a random moment while jobs are flowing.
    threshold = int(count * RNG.uniform(0.15, 0.5))
    wait_for(lambda: len(load.accepted) >= threshold, timeout=120,
             what=f"{threshold} jobs accepted before the fault")
    fault_started, fault_ended = _inject(kind, stack)
    load.join()

    last: dict[str, Any] = {}

    def drained() -> bool:
        rows = rows_of(stack.db, tenant)
        last["statuses"] = Counter(r["status"] for r in rows)
        if len(rows) < count or any(r["status"] not in SETTLED for r in rows):
            return False
        results.poll()
        unpublished = [r["id"] for r in rows
                       if r["status"] != "awaiting_review" and r["id"] not in results.by_job]
        last["unpublished"] = len(unpublished)
        if unpublished:
            return False
        last["lagging"] = lagging_partitions(stack.bootstrap)
        return not last["lagging"]

    try:
        wait_for(drained, timeout=SETTLE_SECONDS, what=f"the backlog to drain after {kind}")
    except AssertionError:
        dead = [n for n, s in stack.services.items() if s.pid and not processes.is_alive(s.pid)]
        raise AssertionError(f"not drained {SETTLE_SECONDS:.0f} s after {kind}: {last}; "
                             f"services not running: {dead}") from None
    drained_at = time.monotonic()
    after_fault = max(0.0, drained_at - fault_ended)
    # Jobs keep arriving after a short fault: the backlog can drain only once both ended.
    recovery = max(0.0, drained_at - max(fault_ended, load.last_accepted))
    print(f"{kind}: fault {fault_ended - fault_started:.1f} s, drained {after_fault:.1f} s "
          f"after it, recovery {recovery:.1f} s")

    rows = {r["id"]: r for r in rows_of(stack.db, tenant)}
    accepted = set(load.accepted.values())
    assert len(accepted) == count, "two keys were answered with one job"
    assert set(rows) == accepted, (f"lost: {len(accepted - set(rows))}, "
                                   f"never accepted: {len(set(rows) - accepted)}")
    reviewing = {j for j, r in rows.items() if r["status"] == "awaiting_review"}
    assert {load.modes[j] for j in reviewing} <= {"low_confidence"}
    wrong_history = [(j, r["status"], r["completions"], r["endings"]) for j, r in rows.items()
                     if r["completions"] != (r["status"] == "completed")
                     or r["endings"] != (r["status"] != "awaiting_review")]
    assert wrong_history == [], f"{len(wrong_history)} jobs with a wrong ending history"

    def outcome(status: str, artifact: dict[str, Any] | None
                ) -> tuple[str, str | None, str | None]:
        return status, (artifact or {}).get("sha256"), (artifact or {}).get("uri")

    disagree = []
    for job_id, row in rows.items():
        published = {outcome(e["status"], e.get("artifact"))
                     for e in results.by_job.get(job_id, [])}
        expected = set() if job_id in reviewing else {outcome(row["status"], row["artifact"])}
        if published != expected:
            disagree.append((job_id, row["status"], published))
    assert disagree == [], f"{len(disagree)} jobs whose results disagree, e.g. {disagree[:3]}"
    overwritten = [j for j, r in rows.items() if r["status"] == "completed"
                   and object_digest(stack.s3, r["artifact"]["uri"]) != r["artifact"]["sha256"]]
    assert overwritten == [], f"{len(overwritten)} artifacts differ from their recorded digest"
    bugs = [(j, r["error"]) for j, r in rows.items()
            if r["error"] and r["error"].get("class") == "bug"]
    assert bugs == [], f"{len(bugs)} jobs dead-lettered as a bug, e.g. {bugs[:3]}"
    dead = [n for n, s in stack.services.items() if s.pid and not processes.is_alive(s.pid)]
    assert dead == [], f"{dead} stopped running"

    statuses = Counter(r["status"] for r in rows.values())
    SUMMARY.append({
        "kind": kind, "jobs": count, "fault_s": fault_ended - fault_started,
        "recovery_s": recovery, "after_fault_s": after_fault,
        "completed": statuses["completed"],
        "dead_letter": statuses["dead_letter"], "awaiting_review": statuses["awaiting_review"],
        "requeued": sum(int(r["requeues"]) for r in rows.values()),
        "reposts": sum(load.refused.values()),
    })


