"""The on-call commands against the real stack: lag, budget, health and tenants list.

Each runs as a subprocess, as a person would run it; `-o jsonl` output is parsed line by
line (every line one JSON object), which is what scripts and these tests rely on.
"""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from typing import Any

import pytest
from confluent_kafka import Consumer, Producer, TopicPartition

from calmq.calls.budget import BucketLimits
from calmq.data import Store
from calmq.data.budget import BudgetLedger
from calmq.kafka import consumer_config, create_topics
from calmq.tooling.devstack import StackState
from tests.support.api import Api, create_tenant
from tests.support.waiting import wait_for

pytestmark = pytest.mark.integration


def _calmq(stack: StackState, *argv: str,
           env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
    clean.update(stack.env, CALMQ_DATA_DIR=stack.data_dir)
    clean.update(env or {})
    return subprocess.run([sys.executable, "-m", "calmq.cli", *argv], env=clean,
                          capture_output=True, text=True, timeout=60, check=False)


def _jsonl(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    """Every stdout line parsed on its own: jsonl is one object per line, nothing else."""
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in done.stdout.splitlines()]
    assert all(isinstance(r, dict) for r in rows)
    return rows


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


# -- lag -----------------------------------------------------------------------------------

def test_lag_shows_each_partitions_offsets_lag_and_oldest_message_age(
        stack: StackState) -> None:
    """A pool of its own with no worker: messages produced with known timestamps, the pool's
    group committed part-way; lag reports exactly those offsets, and the age of the first
    uncommitted message."""
    bootstrap = stack.env["CALMQ_KAFKA_BOOTSTRAP"]
    pool = f"lag{uuid.uuid4().hex[:8]}"
    interactive, bulk = f"calmq.{pool}.interactive", f"calmq.{pool}.bulk"
    create_topics(bootstrap, [interactive, bulk], partitions=2)
    now_ms = int(time.time() * 1000)
    producer = Producer({"bootstrap.servers": bootstrap})
    # Message i of partition 0 is (10 - i) minutes old: the one at offset 2 is 8 minutes old.
    for i in range(5):
        producer.produce(bulk, value=b"m", partition=0, timestamp=now_ms - (10 - i) * 60_000)
    for _ in range(3):
        producer.produce(bulk, value=b"m", partition=1)
    producer.produce(interactive, value=b"m", partition=1)
    assert producer.flush(30) == 0
    committer = Consumer(consumer_config(bootstrap, f"calmq.{pool}"))
    committer.commit(offsets=[TopicPartition(bulk, 0, 2), TopicPartition(bulk, 1, 3),
                              TopicPartition(interactive, 1, 1)], asynchronous=False)
    committer.close()

    rows = _jsonl(_calmq(stack, "lag", "--pools", pool, "-o", "jsonl"))
    parts = {(r["topic"], r["partition"]): r for r in rows if r["kind"] == "partition"}
    totals = {r["topic"]: r for r in rows if r["kind"] == "topic"}

    assert set(parts) == {(t, p) for t in (interactive, bulk) for p in (0, 1)}
    assert {r["pool"] for r in rows} == {pool}
    assert {r["group"] for r in rows} == {f"calmq.{pool}"}
    p0 = parts[(bulk, 0)]
    assert (p0["end_offset"], p0["committed_offset"], p0["lag"]) == (5, 2, 3)
    assert 8 * 60 - 30 < p0["oldest_age_seconds"] < 8 * 60 + 30
    assert (parts[(bulk, 1)]["lag"], parts[(bulk, 1)]["oldest_age_seconds"]) == (0, None)
    never = parts[(interactive, 0)]  # no message, never committed
    assert (never["end_offset"], never["committed_offset"], never["lag"]) == (0, None, 0)
    assert totals[bulk]["lag"] == 3
    assert totals[bulk]["oldest_age_seconds"] == p0["oldest_age_seconds"]
    assert totals[interactive]["lag"] == 0
    # Jobs are counted per topic from PostgreSQL: this pool has none.
    assert (totals[bulk]["in_flight"], totals[bulk]["waiting"]) == (0, 0)
    assert p0["in_flight"] is None

    table = _calmq(stack, "lag", "--pools", pool)
    assert table.returncode == 0, table.stderr
    assert table.stdout.splitlines()[0].split() == [
        "TOPIC", "PARTITION", "END_OFFSET", "COMMITTED_OFFSET", "LAG", "OLDEST_AGE_SECONDS"]
    as_json = json.loads(_calmq(stack, "lag", "--pools", pool, "-o", "json").stdout)
    assert [(r["kind"], r["topic"], r["partition"], r["lag"]) for r in as_json] == [
        (r["kind"], r["topic"], r["partition"], r["lag"]) for r in rows]  # the same rows


def test_lag_counts_jobs_a_worker_holds_in_flight(stack: StackState) -> None:
    """A job the default pool's worker is running shows in its topic's in_flight."""
    api = Api(stack.env["CALMQ_API_URL"],
              create_tenant(stack.env["CALMQ_DATABASE_URL"], f"lag-{uuid.uuid4().hex[:8]}"))
    job_id = api.submit({"text": "slow enough to be seen", "mode": "success",
                         "delay_ms": 8000}, priority="interactive")

    def held() -> dict[str, Any] | None:
        rows = _jsonl(_calmq(stack, "lag", "--pools", "default", "-o", "jsonl"))
        topic = next(r for r in rows if r["kind"] == "topic"
                     and r["topic"] == "calmq.default.interactive")
        return topic if topic["in_flight"] >= 1 else None

    topic = wait_for(held, timeout=30, what=f"job {job_id} in flight")
    assert topic["group"] == "calmq.default"
    assert api.job(job_id)["status"] == "running"


def test_lag_without_the_database_still_shows_kafkas_side(stack: StackState) -> None:
    """Lag is Kafka's: with PostgreSQL unreachable the offsets are still shown, jobs in
    flight are null, and a warning names why."""
    port = _closed_port()
    done = _calmq(stack, "lag", "--pools", "default", "-o", "jsonl",
                  env={"CALMQ_DATABASE_URL": f"postgresql://calmq@127.0.0.1:{port}/calmq"})
    rows = _jsonl(done)
    assert {r["topic"] for r in rows} == {"calmq.default.interactive", "calmq.default.bulk"}
    assert all(r["in_flight"] is None for r in rows)
    assert done.stderr.startswith("calmq: warning: jobs in flight unknown: ")
    assert f"127.0.0.1:{port}" in done.stderr


# -- budget --------------------------------------------------------------------------------

def _store_run(stack: StackState, work: Any) -> Any:
    async def run() -> Any:
        store = Store(stack.env["CALMQ_DATABASE_URL"], max_size=1)
        await store.open()
        try:
            return await work(store)
        finally:
            await store.close()

    return asyncio.run(run())


def test_budget_shows_limits_what_is_left_the_debt_and_use_by_tenant(stack: StackState) -> None:
    """A bucket of its own (its own model name) put into debt by a call larger than the
    bucket, and a tenant's finished job: budget reports the limits, the bulk debt, and the
    tenant's tokens at its priority within the window."""
    model = f"ops-{uuid.uuid4().hex[:8]}"
    limits = BucketLimits(tokens_per_minute=6000, requests_per_minute=600)

    async def into_debt(store: Store) -> None:
        ledger = BudgetLedger(store)
        await ledger.configure("openai", model, limits)
        # Once the bulk bucket is full, a call needing more than it holds is granted and
        # leaves it in debt (migration 0005).
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            grant = await ledger.take("openai", model, "bulk", need_tokens=20_000,
                                      want_tokens=20_000, want_requests=1)
            if grant.tokens:
                return
            await asyncio.sleep(min(grant.wait_seconds, 0.5))
        raise AssertionError("the bucket never granted the oversized call")

    _store_run(stack, into_debt)
    tenant = f"budget-{uuid.uuid4().hex[:8]}"
    api = Api(stack.env["CALMQ_API_URL"],
              create_tenant(stack.env["CALMQ_DATABASE_URL"], tenant))
    job_id = api.submit({"text": "count my tokens", "mode": "success"}, priority="bulk")
    wait_for(lambda: api.job(job_id)["status"] == "completed", timeout=60,
             what=f"job {job_id} to complete")

    done = _calmq(stack, "budget", "-o", "json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    bucket = next(b for b in report["buckets"] if b["model"] == model)
    assert (bucket["tokens_per_minute"], bucket["requests_per_minute"]) == (6000, 600)
    assert bucket["interactive_share"] == pytest.approx(0.2)
    bulk = bucket["priorities"]["bulk"]
    # 20,000 granted from at most a full bulk bucket; the refill since (under 80 tokens a
    # second) pays a little back.
    assert 20_000 - bulk["tokens_cap"] - 5_000 < bulk["debt_tokens"] <= 20_000
    assert bulk["tokens_left"] == 0
    assert bucket["priorities"]["interactive"]["debt_tokens"] == 0
    assert report["in_debt"] is True
    assert report["window_seconds"] == 60
    use = [u for u in report["use_by_tenant"] if u["tenant"] == tenant]
    assert [u["priority"] for u in use] == ["bulk"]
    assert use[0]["tokens"] == use[0]["input_tokens"] + use[0]["output_tokens"] > 0
    assert use[0]["model_calls"] >= 1
    by_priority = {p["priority"]: p for p in report["use_by_priority"]}
    assert by_priority["bulk"]["tokens"] >= use[0]["tokens"]

    line = _jsonl(_calmq(stack, "budget", "--window", "5m", "-o", "jsonl"))
    assert len(line) == 1
    assert line[0]["window_seconds"] == 300
    table = _calmq(stack, "budget")
    assert table.returncode == 0, table.stderr
    assert f"openai/{model}: 6000 tokens/min, 600 requests/min" in table.stdout
    assert tenant in table.stdout


# -- health --------------------------------------------------------------------------------

def test_health_is_every_part_up_and_exit_0(stack: StackState) -> None:
    """Every part the settings name is up (the model providers too: none blocked), each with
    its address and reason, and the command exits 0."""
    rows = _jsonl(_calmq(stack, "health", "-o", "jsonl"))
    by_part = {r["part"]: r for r in rows}
    assert set(by_part) == {"postgres", "kafka", "schema-registry", "object-store", "api",
                            "fake-provider", "providers"}
    assert all(r["healthy"] is True and r["status"] == "up" for r in rows), rows
    assert by_part["api"]["address"] == stack.env["CALMQ_API_URL"]
    assert "schema version" in by_part["postgres"]["reason"]


def test_health_names_the_part_that_is_down_and_exits_1(stack: StackState) -> None:
    """The schema registry pointed at a closed port: that part is DOWN with its address and
    the reason, the others stay up, and the command exits 1 within seconds."""
    port = _closed_port()
    started = time.monotonic()
    done = _calmq(stack, "health", "-o", "jsonl",
                  env={"CALMQ_SCHEMA_REGISTRY_URL": f"http://127.0.0.1:{port}"})
    elapsed = time.monotonic() - started
    assert done.returncode == 1, done.stderr
    by_part = {r["part"]: r for r in map(json.loads, done.stdout.splitlines())}
    down = by_part["schema-registry"]
    assert (down["healthy"], down["status"]) == (False, "DOWN")
    assert down["address"] == f"http://127.0.0.1:{port}"
    assert "refused" in down["reason"].lower()
    assert all(r["healthy"] for p, r in by_part.items() if p != "schema-registry")
    assert "Traceback" not in done.stderr
    # The probes run at once, each bounded by its own few-second timeout: a refused port
    # returns within seconds, never hangs (the margin covers the CLI's start and its seven
    # probes on a loaded two-core machine: 12 s seen at load 11).
    assert elapsed < 20
    table = _calmq(stack, "health", env={"CALMQ_SCHEMA_REGISTRY_URL": f"http://127.0.0.1:{port}"})
    assert table.returncode == 1
    assert any(line.startswith("schema-registry") and "DOWN" in line
               for line in table.stdout.splitlines())


# -- tenants list --------------------------------------------------------------------------

def test_tenants_list_shows_keys_by_prefix_revoked_keys_and_last_use(stack: StackState) -> None:
    name = f"list-{uuid.uuid4().hex[:8]}"
    first = _calmq(stack, "tenants", "create", name)
    assert first.returncode == 0, first.stderr
    first_key = first.stdout.strip().splitlines()[-1]
    second = _calmq(stack, "tenants", "add-key", name)
    second_key = second.stdout.strip().splitlines()[-1]
    revoked = _calmq(stack, "tenants", "revoke-key", name, "--key-prefix", first_key[:12])
    assert revoked.returncode == 0, revoked.stderr

    rows = _jsonl(_calmq(stack, "tenants", "list", name, "-o", "jsonl"))
    assert [r["name"] for r in rows] == [name]
    tenant = rows[0]
    assert [k["prefix"] for k in tenant["keys"]] == [first_key[:12], second_key[:12]]
    assert tenant["active_keys"] == [second_key[:12]]
    assert tenant["revoked_keys"] == [first_key[:12]]
    assert tenant["keys"][0]["revoked_at"] is not None
    assert {k["role"] for k in tenant["keys"]} == {"tenant"}
    assert first_key not in json.dumps(rows)  # prefixes only, never a key
    assert tenant["last_used_at"] is None

    api = Api(stack.env["CALMQ_API_URL"], second_key)
    api.submit({"text": "mark the tenant used", "mode": "success"})
    used = _jsonl(_calmq(stack, "tenants", "list", name, "-o", "jsonl"))[0]
    assert used["last_used_at"] is not None
    assert used["last_used_at"] >= used["created_at"]

    everyone = _jsonl(_calmq(stack, "tenants", "list", "-o", "jsonl"))
    assert name in [r["name"] for r in everyone]
    table = _calmq(stack, "tenants", "list")
    assert table.stdout.splitlines()[0].split()[:2] == ["NAME", "ID"]
    assert any(line.startswith(name) and second_key[:12] in line
               for line in table.stdout.splitlines())
    missing = _calmq(stack, "tenants", "list", f"absent-{uuid.uuid4().hex[:6]}")
    assert missing.returncode == 1
    assert "no tenants" in missing.stdout
    usage = _calmq(stack, "tenants", "create")
    assert usage.returncode == 2
    assert usage.stderr.startswith("calmq: error [usage]: ")


def test_tenants_commands_that_show_a_key_or_secret_print_it_as_json(
        stack: StackState) -> None:
    """create, add-key, platform-key and webhook-secret with -o json: one object naming the
    key or secret, which works against the API, and no sentence on stdout."""
    name = f"json-{uuid.uuid4().hex[:8]}"
    created = _calmq(stack, "tenants", "create", name, "-o", "json")
    assert created.returncode == 0, created.stderr
    doc = json.loads(created.stdout)
    assert doc["tenant"] == name
    assert uuid.UUID(doc["id"])
    Api(stack.env["CALMQ_API_URL"], doc["api_key"]).submit({"text": "json key", "mode": "success"})

    added = json.loads(_calmq(stack, "tenants", "add-key", name, "-o", "json").stdout)
    assert added["tenant"] == name
    assert added["api_key"] != doc["api_key"]
    platform = json.loads(_calmq(stack, "tenants", "platform-key", "-o", "json").stdout)
    assert platform["api_key"]
    secret = json.loads(_calmq(stack, "tenants", "webhook-secret", name, "-o", "json").stdout)
    assert secret["tenant"] == name
    assert secret["webhook_secret"]
    rotated = _calmq(stack, "tenants", "webhook-secret", name, "--rotate", "-o", "jsonl")
    assert rotated.returncode == 0, rotated.stderr
    assert json.loads(rotated.stdout)["webhook_secret"] != secret["webhook_secret"]


# -- deployment commands' output -------------------------------------------------------------

def test_deployment_commands_print_jsonl_rows(stack: StackState) -> None:
    """topics create, schemas register and dev status take -o jsonl like the rest."""
    topics = _jsonl(_calmq(stack, "topics", "create", "-o", "jsonl"))
    assert {"calmq.default.interactive", "calmq.default.bulk", "calmq.dlq"} <= {
        t["topic"] for t in topics}
    assert not any(t["created"] for t in topics)  # the stack made them all already
    schemas = _jsonl(_calmq(stack, "schemas", "register", "-o", "jsonl"))
    assert "job.requested" in {s["event_type"] for s in schemas}
    assert all(isinstance(s["schema_id"], int) for s in schemas)
    parts = _jsonl(_calmq(stack, "dev", "status", "-o", "jsonl"))
    assert {"postgres", "kafka", "api", "worker"} <= {p["name"] for p in parts}
    assert all(p["healthy"] for p in parts)
    as_json = json.loads(_calmq(stack, "dev", "status", "--json").stdout)
    assert [p["name"] for p in as_json] == [p["name"] for p in parts]
