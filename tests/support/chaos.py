"""The chaos test's own stack, the faults it injects, the load it drives and the checks it makes.

The fault matrix stops Kafka and restarts PostgreSQL, so it runs on a stack of its own (the
session stack's parts are shared by every other test): Kafka, PostgreSQL and the schema
registry started by the same code as `calmq dev up`, an S3 endpoint (moto's server, a real
HTTP S3 API) for the object store, and calmq's services as separate processes: the API, the
relay, two workers and the forwarder, plus the fake provider. The schema registry and the
object store are reached through TCP fault proxies, so a test can take them away.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psycopg
from confluent_kafka import Consumer, TopicPartition
from psycopg.rows import dict_row

from calmq import topics
from calmq.codec import decode_message, make_codec
from calmq.tooling.devstack import Stack, StackState, kafka, postgres, processes
from tests.support.api import create_tenant
from tests.support.faultproxy import FaultProxy
from tests.support.waiting import wait_for

ROOT = Path(__file__).resolve().parents[2]
TIERS = ["1s", "2s", "4s"]
POOL = "default"
BUCKET = "calmq-chaos"
SETTLED = ("completed", "dead_letter", "cancelled", "awaiting_review")
# The mix every fault sees: mostly work that completes, and each other ending a job can have
# (a retry that then succeeds, review, a verifier failure, transient failures that use up
# the attempts, a rate limit, step timeouts).
MODES = ["success"] * 8 + ["flaky", "low_confidence", "malformed", "always_fail",
                           "rate_limited", "slow"]
# Short lease and retry tiers so the matrix recovers in seconds; `slow` outlasts the step
# timeout. The sweeper keeps its default grace (10 min): a job that lost its message must
# show up as stuck here, not be rescued quietly.
SERVICE_SETTINGS = {
    "CALMQ_RETRY_TIERS": ",".join(TIERS),
    "CALMQ_RETRY_INITIAL_SECONDS": "0.5",
    "CALMQ_LEASE_SECONDS": "4",
    "CALMQ_GRACE_SECONDS": "2",
    "CALMQ_STEP_TIMEOUT_SECONDS": "2",
    "CALMQ_CONCURRENCY": "64",
    "CALMQ_METRICS_HOST": "127.0.0.1",
}


def _get(url: str, timeout: float = 1) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


def _metrics_up(port: int) -> Callable[[], bool]:
    return lambda: _get(f"http://127.0.0.1:{port}/metrics")


@dataclass
class Service:
    """One calmq process that the matrix kills and brings back the way a supervisor would."""

    name: str
    args: list[str]
    env: dict[str, str]
    log: Path
    probe: Callable[[], bool]
    pid: int | None = None

    def start(self) -> None:
        self.pid = processes.start([sys.executable, "-m", "calmq.cli", *self.args], self.log,
                                   env=self.env, cwd=ROOT)
        pid = self.pid
        processes.wait_until(self.probe, timeout=60, what=self.name,
                             alive=lambda: processes.is_alive(pid))

    def kill9(self) -> None:
        assert self.pid is not None
        processes.stop(self.pid, sig=signal.SIGKILL, timeout=5)

    def stop(self) -> None:
        if self.pid is not None:
            processes.stop(self.pid, timeout=15)


class ChaosStack:
    """Everything the fault matrix runs against; ``close`` stops all of it."""

    def __init__(self, home: Path, *, brokers: int = 1, standby: bool = False) -> None:
        self.home = home
        base = {k: v for k, v in os.environ.items() if not k.startswith(("CALMQ_", "AWS_"))}
        self.stack = Stack(home / "stack", {**base, "CALMQ_RETRY_TIERS": ",".join(TIERS),
                                            "CALMQ_TOPIC_PARTITIONS": "4"}, brokers=brokers,
                           standby=standby)
        self.db_proxy: FaultProxy | None = None
        self.services: dict[str, Service] = {}
        self.proxies: list[FaultProxy] = []
        self.moto: subprocess.Popen[bytes] | None = None
        self.state: StackState = self.stack.up(services=[], log=lambda _m: None)
        try:
            self._start(base)
        except BaseException:
            self.close()
            raise

    # -- start and stop ------------------------------------------------------------------

    def _start(self, base: dict[str, str]) -> None:
        env = dict(self.state.env)
        self.db = env["CALMQ_DATABASE_URL"]
        if self.stack.standby:
            # The services reach PostgreSQL through one address that a failover points at
            # the promoted standby, as a cloud database's endpoint does.
            primary = urlparse(self.db)
            self.db_proxy = self._proxy("127.0.0.1", primary.port or 5432)
            self.db = primary._replace(netloc=f"postgres@127.0.0.1:{self.db_proxy.port}"
                                       ).geturl()
            env["CALMQ_DATABASE_URL"] = self.db
        self.bootstrap = env["CALMQ_KAFKA_BOOTSTRAP"]
        self.registry_url = env["CALMQ_SCHEMA_REGISTRY_URL"]
        registry = urlparse(self.registry_url)
        self.registry_proxy = self._proxy(registry.hostname or "127.0.0.1", registry.port or 80)
        moto_port = processes.free_port()
        with (self.home / "moto.log").open("ab") as out:
            self.moto = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(moto_port)],
                stdout=out, stderr=subprocess.STDOUT, env=base)
        self.s3_direct = f"http://127.0.0.1:{moto_port}"
        wait_for(lambda: processes.port_open("127.0.0.1", moto_port), timeout=30,
                 what="moto's S3 server")
        self.s3 = self._s3_client(self.s3_direct)
        self.s3.create_bucket(Bucket=BUCKET)
        self.objects_proxy = self._proxy("127.0.0.1", moto_port)

        provider_port = processes.free_port()
        self.provider_url = f"http://127.0.0.1:{provider_port}"
        self.api_url = f"http://127.0.0.1:{processes.free_port()}"
        self.service_env = {
            **base, **env, **SERVICE_SETTINGS,
            "PYTHONUNBUFFERED": "1",
            "CALMQ_SCHEMA_REGISTRY_URL": registry._replace(
                netloc=f"127.0.0.1:{self.registry_proxy.port}").geturl(),
            "CALMQ_OBJECT_STORE_URL": f"s3://{BUCKET}/objects",
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.objects_proxy.port}",
            "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
            "CALMQ_FAKE_PROVIDER_URL": self.provider_url,
            "CALMQ_API_PORT": self.api_url.rsplit(":", 1)[1],
        }
        self._service("fake-provider", ["fake-provider", "--port", str(provider_port),
                                        "--latency-ms", "20", "--slow-seconds", "4"],
                      lambda: _get(self.provider_url + "/healthz"))
        self._service("api", ["api"], lambda: _get(self.api_url + "/healthz"))
        for name in ("relay", "worker-1", "worker-2", "forwarder"):
            port = processes.free_port()
            command = name.split("-")[0]
            self._service(name, [command, "--metrics-port", str(port)], _metrics_up(port))

    def _proxy(self, host: str, port: int) -> FaultProxy:
        proxy = FaultProxy(host, port)
        self.proxies.append(proxy)
        return proxy

    def _service(self, name: str, args: list[str], probe: Callable[[], bool]) -> None:
        service = Service(name, args, dict(self.service_env), self.home / "logs" / f"{name}.log",
                          probe)
        self.services[name] = service
        service.start()

    @staticmethod
    def _s3_client(endpoint: str) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test",
                            aws_secret_access_key="test", region_name="us-east-1")

    def close(self) -> None:
        for service in self.services.values():
            service.stop()
        for proxy in self.proxies:
            proxy.close()
        if self.moto is not None:
            self.moto.terminate()
            try:
                self.moto.wait(10)
            except subprocess.TimeoutExpired:
                self.moto.kill()
                self.moto.wait(10)
        self.stack.down(log=lambda _m: None)

    # -- the infrastructure faults --------------------------------------------------------

    def _part(self, name: str) -> tuple[StackState, int, str]:
        state = self.stack.state()
        assert state is not None
        part = next(p for p in state.parts if p.name == name)
        assert part.pid is not None
        return state, part.pid, part.address

    def _record_pid(self, state: StackState, name: str, pid: int) -> None:
        # `down` stops the parts by the pids in stack.json: the restarted one must be there.
        next(p for p in state.parts if p.name == name).pid = pid
        self.stack.state_file.write_text(state.to_json())

    def restart_postgres(self) -> None:
        state, pid, address = self._part("postgres")
        server = postgres.PostgresServer(self.stack.data_dir / "postgres",
                                         int(address.rsplit(":", 1)[1]))
        processes.stop(pid, sig=signal.SIGINT, timeout=30)  # fast shutdown, as pg_ctl does
        new = server.start(fresh=False)
        self._record_pid(state, "postgres", new)
        processes.wait_until(server.ready, timeout=60, what="PostgreSQL after its restart",
                             alive=lambda: processes.is_alive(new))

    def stop_kafka(self) -> Callable[[], None]:
        """Stop the broker; the function returned starts it again and waits until it serves."""
        state, pid, address = self._part("kafka")
        home = self.stack.data_dir / "kafka"
        voters = re.search(r"controller\.quorum\.voters=1@127\.0\.0\.1:(\d+)",
                           (home / "server.properties").read_text())
        assert voters is not None
        broker = kafka.KafkaBroker(home, int(address.rsplit(":", 1)[1]), int(voters[1]))
        processes.stop(pid, timeout=60)

        def start() -> None:
            seen = broker.log_file.stat().st_size
            new = broker.start(kafka.ensure_jars(), fresh=False)
            self._record_pid(state, "kafka", new)

            def started() -> bool:
                with broker.log_file.open("rb") as f:
                    f.seek(seen)
                    return b"Kafka Server started" in f.read()

            processes.wait_until(started, timeout=90, what="Kafka after its restart",
                                 alive=lambda: processes.is_alive(new))

        return start

    # -- a three-broker cluster (`calmq dev up --brokers 3`) ---------------------------------

    def broker(self, node_id: int) -> kafka.KafkaBroker:
        """Node ``node_id`` of the cluster, as its server.properties describe it."""
        home = self.stack.data_dir / "kafka" / f"node-{node_id}"
        props = dict(line.split("=", 1) for line in
                     (home / "server.properties").read_text().splitlines() if "=" in line)
        port = int(props["advertised.listeners"].rsplit(":", 1)[1])
        controller = int(props["listeners"].rsplit(":", 1)[1])
        return kafka.KafkaBroker(home, port, controller, node_id=node_id,
                                 voters=props["controller.quorum.voters"],
                                 replication=int(props["default.replication.factor"]))

    def leaders(self, names: list[str]) -> Counter[int]:
        """How many partitions of the topics ``names`` each broker leads."""
        from confluent_kafka.admin import AdminClient

        meta = AdminClient({"bootstrap.servers": self.bootstrap}).list_topics(timeout=10)
        return Counter(p.leader for name in names for p in meta.topics[name].partitions.values())

    def controller(self) -> int:
        """The active KRaft controller (the quorum leader), as a live node records it."""
        state = self.stack.state()
        assert state is not None
        for part in state.parts:
            if part.name.startswith("kafka-") and part.pid and processes.is_alive(part.pid):
                leader = self.broker(int(part.name.split("-")[1])).quorum_leader()
                if leader is not None:
                    return leader
        raise AssertionError("no live node knows the quorum leader")

    def kill_broker(self, node_id: int) -> Callable[[], None]:
        """kill -9 node ``node_id``; the function returned starts it again on its data and
        waits until it serves."""
        name = f"kafka-{node_id}"
        state, pid, _address = self._part(name)
        broker = self.broker(node_id)
        processes.stop(pid, sig=signal.SIGKILL, timeout=10)

        def start() -> None:
            seen = broker.log_file.stat().st_size
            new = broker.start(kafka.ensure_jars(), fresh=False)
            self._record_pid(state, name, new)

            def started() -> bool:
                with broker.log_file.open("rb") as f:
                    f.seek(seen)
                    return b"Kafka Server started" in f.read()

            processes.wait_until(started, timeout=120, what=f"Kafka node {node_id} after kill",
                                 alive=lambda: processes.is_alive(new))

        return start

    # -- a primary and a streaming standby (`calmq dev up --standby`) ----------------------

    def standby_url(self) -> str:
        _state, _pid, address = self._part("postgres-standby")
        return f"postgresql://postgres@{address}/calmq"

    def synced_slot(self, slot: str = "calmq_outbox") -> bool:
        """Whether the standby holds a persistent synchronised copy of the relay's slot."""
        with psycopg.connect(self.standby_url()) as conn:
            row = conn.execute("SELECT synced AND NOT temporary FROM pg_replication_slots "
                               "WHERE slot_name = %s", (slot,)).fetchone()
        return bool(row and row[0])

    def fail_over(self) -> None:
        """kill -9 the primary, promote the standby and point the database address at it."""
        assert self.db_proxy is not None
        _state, pid, _address = self._part("postgres")
        _sstate, _spid, standby_address = self._part("postgres-standby")
        processes.stop(pid, sig=signal.SIGKILL, timeout=10)
        server = postgres.PostgresServer(self.stack.data_dir / "postgres-standby",
                                         int(standby_address.rsplit(":", 1)[1]))
        server.promote()
        self.db_proxy.retarget("127.0.0.1", server.port)

    def provider_outage(self, seconds: float) -> None:
        body = json.dumps({"seconds": seconds, "statuses": [500, 429]}).encode()
        req = urllib.request.Request(self.provider_url + "/admin/outage", data=body,
                                     method="POST",
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200


# -- load ---------------------------------------------------------------------------------


@dataclass
class Load:
    """``count`` jobs of mixed modes posted at an even pace over ``seconds``.

    Each job has an Idempotency-Key and is posted again (same key, same body) until it is
    answered 202, as a careful client does while the API or PostgreSQL is away: every job
    ends up accepted exactly once, and ``accepted`` maps each key to its job id.
    """

    api_url: str
    key: str
    tag: str
    count: int
    seconds: float
    accepted: dict[str, str] = field(default_factory=dict)
    modes: dict[str, str] = field(default_factory=dict)
    refused: Counter[str] = field(default_factory=Counter)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stopped: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, clients: int = 8) -> Load:
        self.started = self.last_accepted = time.monotonic()
        self.next = iter(range(self.count))
        for _ in range(clients):
            thread = threading.Thread(target=self._client, daemon=True)
            thread.start()
            self.threads.append(thread)
        return self

    def join(self, timeout: float = 180) -> None:
        for thread in self.threads:
            thread.join(timeout)
        assert not any(t.is_alive() for t in self.threads), "the load did not finish"
        assert len(self.accepted) == self.count, (
            f"{self.count - len(self.accepted)} jobs never accepted; refusals {self.refused}")

    def _client(self) -> None:
        rng = random.Random()
        while True:
            with self.lock:
                i = next(self.next, None)
            if i is None:
                return
            # The pace of the load (a job every seconds/count), not a synchronisation.
            self.stopped.wait(max(0.0, self.started + i * self.seconds / self.count
                                  - time.monotonic()))
            mode = MODES[i % len(MODES)]
            # Both priorities: the group balances partition counts, not topics, so a worker
            # may own only interactive (or only bulk) partitions; this way each has work.
            body = {"workflow": "summarize", "priority": ("interactive", "bulk")[i % 2],
                    "input": {"text": f"chaos {self.tag} job {i} of a fault matrix run",
                              "mode": mode, "fail_times": 1,
                              "delay_ms": rng.randint(100, 600)}}
            self._post(f"{self.tag}-{i}", body, mode)

    def _post(self, key: str, body: dict[str, Any], mode: str) -> None:
        data = json.dumps(body).encode()
        deadline = time.monotonic() + 150
        while time.monotonic() < deadline:
            req = urllib.request.Request(self.api_url + "/v1/jobs", data=data, method="POST",
                                         headers={"Authorization": f"Bearer {self.key}",
                                                  "Content-Type": "application/json",
                                                  "Idempotency-Key": key})
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    job_id = str(json.loads(resp.read())["job_id"])
                with self.lock:
                    self.accepted[key] = job_id
                    self.modes[job_id] = mode
                    self.last_accepted = time.monotonic()
                return
            except urllib.error.HTTPError as exc:
                exc.read()
                reason = str(exc.code)
            except OSError as exc:  # refused, reset, timed out: the API is away
                reason = type(exc).__name__
            with self.lock:
                self.refused[reason] += 1
            self.stopped.wait(0.2)  # a client's back-off before it posts again


def new_tenant(db: str, tag: str) -> tuple[str, str]:
    """A tenant of one fault's jobs: its name and API key."""
    name = f"chaos-{tag}-{uuid.uuid4().hex[:6]}"
    return name, create_tenant(db, name)


# -- observation --------------------------------------------------------------------------


class Results:
    """Everything on calmq.results since the start, decoded: job id -> its result events."""

    def __init__(self, bootstrap: str, registry_url: str) -> None:
        self.codec = make_codec(registry_url)
        self.consumer = Consumer({
            "bootstrap.servers": bootstrap, "group.id": f"chaos-results-{uuid.uuid4().hex}",
            "enable.auto.commit": False, "auto.offset.reset": "earliest",
        })
        meta = self.consumer.list_topics(topics.RESULTS, timeout=10).topics[topics.RESULTS]
        self.consumer.assign([TopicPartition(topics.RESULTS, p, 0) for p in meta.partitions])
        self.by_job: dict[str, list[dict[str, Any]]] = {}

    def poll(self) -> None:
        while True:
            batch = self.consumer.consume(num_messages=5000, timeout=0.2)
            for msg in batch:
                if msg.error() or msg.value() is None:
                    continue
                _type, event = decode_message(self.codec, bytes(msg.value() or b""), None)
                self.by_job.setdefault(str(event["job_id"]), []).append(event)
            if len(batch) < 5000:
                return

    def close(self) -> None:
        self.consumer.close()


def lagging_partitions(bootstrap: str) -> list[str]:
    """Partitions whose group's committed offset is short of the log end (work topics:
    the pool's workers; retry tiers: the forwarder)."""
    groups = {f"calmq.{POOL}": [topics.topic_for_route(topics.work_route(POOL, p))
                                 for p in ("interactive", "bulk")],
              "calmq.forwarder": [topics.topic_for_route(topics.retry_route(t)) for t in TIERS]}
    lagging = []
    for group, names in groups.items():
        # A consumer of the group that never subscribes: it reads the committed offsets
        # without joining (and without the admin client's group requests, which abort the
        # process when the broker goes away: calmq/lag.py).
        probe = Consumer({"bootstrap.servers": bootstrap, "group.id": group,
                          "enable.auto.commit": False})
        try:
            meta = probe.list_topics(timeout=10).topics
            tps = [TopicPartition(t, p) for t in names for p in meta[t].partitions]
            committed = {(tp.topic, tp.partition): tp.offset
                         for tp in probe.committed(tps, timeout=10)}
            for tp in tps:
                low, high = probe.get_watermark_offsets(tp, timeout=10)
                at = committed.get((tp.topic, tp.partition), -1001)
                if high > low and at < high:
                    lagging.append(f"{group} {tp.topic}[{tp.partition}] at {at} of {high}")
        finally:
            probe.close()
    return lagging


def rows_of(db: str, tenant: str) -> list[dict[str, Any]]:
    """Every job row of the tenant named ``tenant``, with its history counts."""
    with psycopg.connect(db, row_factory=dict_row) as conn:
        return conn.execute(
            """SELECT j.id::text AS id, j.status, j.artifact, j.error,
                      (SELECT count(*) FROM job_events e WHERE e.job_id = j.id
                        AND e.type = 'completed') AS completions,
                      (SELECT count(*) FROM job_events e WHERE e.job_id = j.id
                        AND e.type IN ('completed', 'dead_lettered', 'cancelled')) AS endings,
                      (SELECT count(*) FROM job_events e WHERE e.job_id = j.id
                        AND e.type = 'requeued_after_restart') AS requeues
                 FROM jobs j JOIN tenants t ON t.id = j.tenant_id
                WHERE t.name = %s""", (tenant,)).fetchall()


def object_digest(s3: Any, uri: str) -> str:
    parsed = urlparse(uri)
    body = s3.get_object(Bucket=parsed.netloc, Key=parsed.path.lstrip("/"))["Body"].read()
    return hashlib.sha256(body).hexdigest()

