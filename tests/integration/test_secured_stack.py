"""Every calmq part against a broker with only a SASL_SSL listener and a registry behind
HTTPS with basic auth: `calmq dev up --secure`, as clusters in production run them.

One secured stack (tests/integration/conftest.py: ``secured_stack``, its start costs ~30 s)
is shared by this module and the pods-as-rendered test: the broker speaks SASL_SSL with
SCRAM-SHA-512 and a CA made at start, on every listener; the registry (Apicurio, HTTPS only)
sits behind an authenticating proxy; the services read their passwords from files
(``CALMQ_*_PASSWORD_FILE``), with short retry tiers and a quick batch lane.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
from confluent_kafka import Consumer, TopicPartition

from calmq.codec import make_codec, registry_config
from calmq.kafka import connection_config
from calmq.settings import Settings
from calmq.tooling.devstack import Stack, StackState
from tests.support.api import Api, create_tenant
from tests.support.waiting import wait_for

pytestmark = pytest.mark.e2e

_SECURITY_KEYS = ("CALMQ_KAFKA_SECURITY_PROTOCOL", "CALMQ_KAFKA_SASL_MECHANISM",
                  "CALMQ_KAFKA_SASL_USERNAME", "CALMQ_KAFKA_SASL_PASSWORD_FILE",
                  "CALMQ_KAFKA_SSL_CA_LOCATION")


@pytest.fixture(scope="module")
def secured(secured_stack: StackState) -> StackState:
    """The secured stack with every service, short retry tiers and a quick batch lane."""
    return secured_stack


def _calmq(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
    return subprocess.run([sys.executable, "-m", "calmq.cli", *args], env={**base, **env},
                          capture_output=True, text=True, timeout=60, check=False)


def _settings(state: StackState) -> Settings:
    return Settings.load(environ=dict(state.env))


def test_no_plaintext_listener_is_open(secured: StackState) -> None:
    """The broker's and the registry's ports refuse plaintext: Kafka closes the connection
    at the first request, the registry answers only TLS, and without credentials 401."""
    import ssl
    import urllib.error
    import urllib.request

    broker_config = Path(secured.data_dir, "kafka", "server.properties").read_text()
    listeners = next(line for line in broker_config.splitlines()
                     if line.startswith("listeners="))
    assert "PLAINTEXT://" not in listeners.replace("SASL_SSL://", "")
    assert "listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:SSL" in broker_config
    registry = secured.env["CALMQ_SCHEMA_REGISTRY_URL"]
    assert registry.startswith("https://")
    apicurio = next(p for p in secured.parts if p.name == "schema-registry")
    assert apicurio.address.startswith("https://")
    plain = registry.replace("https://", "http://")
    with pytest.raises((urllib.error.URLError, ConnectionError)):
        urllib.request.urlopen(plain + "/subjects", timeout=3)
    tls = ssl.create_default_context(cafile=secured.env["CALMQ_KAFKA_SSL_CA_LOCATION"])
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(registry + "/subjects", timeout=3, context=tls)
    assert refused.value.code == 401


def test_a_job_goes_through_api_relay_worker_and_results_on_the_secured_stack(
        secured: StackState) -> None:
    """A job submitted over HTTP completes, and its result event is read from calmq.results
    through SASL_SSL and decoded with the authenticated registry."""
    api = Api(secured.env["CALMQ_API_URL"],
              create_tenant(secured.env["CALMQ_DATABASE_URL"], f"sec-{uuid.uuid4().hex[:6]}"))
    job_id = api.submit({"text": "secured end to end", "mode": "success"})
    job = wait_for(lambda: (j := api.job(job_id))["status"] == "completed" and j,
                   timeout=60, what="the job to complete")
    assert job["attempt"] == 1
    settings = _settings(secured)
    codec = make_codec(settings.schema_registry_url, registry_config(settings))
    consumer = Consumer({**connection_config(settings), "group.id": f"t-{uuid.uuid4()}",
                         "auto.offset.reset": "earliest"})
    found: list[dict[str, Any]] = []
    try:
        meta = consumer.list_topics("calmq.results", timeout=10)
        consumer.assign([TopicPartition("calmq.results", p, 0)
                         for p in meta.topics["calmq.results"].partitions])

        def seen() -> bool:
            for msg in consumer.consume(100, timeout=0.2):
                if msg.error() is None and msg.key() == job_id.encode():
                    found.append(codec.decode(msg.value())[1])
            return bool(found)

        wait_for(seen, timeout=30, what="the result on calmq.results")
    finally:
        consumer.close()
    assert found[0]["status"] == "completed"


def test_a_retry_goes_through_the_forwarder_on_the_secured_stack(secured: StackState) -> None:
    """A job that fails twice with 503 is retried through the retry tiers (the forwarder
    republishes over SASL_SSL) and completes on its third attempt."""
    api = Api(secured.env["CALMQ_API_URL"],
              create_tenant(secured.env["CALMQ_DATABASE_URL"], f"sec-{uuid.uuid4().hex[:6]}"))
    job_id = api.submit({"text": "flaky then fine", "mode": "flaky", "fail_times": 2})
    job = wait_for(lambda: (j := api.job(job_id))["status"] in ("completed", "dead_letter")
                   and j, timeout=90, what="the flaky job to finish")
    assert job["status"] == "completed"
    assert job["attempt"] == 3
    assert [e["type"] for e in job["events"]].count("retry_scheduled") == 2


def test_a_batch_lane_job_goes_through_the_batcher_on_the_secured_stack(
        secured: StackState) -> None:
    """A batch-lane job is packed by the batcher (a consumer over SASL_SSL) and completes."""
    api = Api(secured.env["CALMQ_API_URL"],
              create_tenant(secured.env["CALMQ_DATABASE_URL"], f"sec-{uuid.uuid4().hex[:6]}"))
    job_id = api.submit({"text": "through the batch lane", "mode": "success"},
                        lane="batch", priority="bulk", deadline_seconds=600)
    job = wait_for(lambda: (j := api.job(job_id))["status"] in ("completed", "dead_letter")
                   and j, timeout=90, what="the batch-lane job to finish")
    assert job["status"] == "completed"
    import psycopg

    with psycopg.connect(secured.env["CALMQ_DATABASE_URL"]) as conn:
        lane = conn.execute("SELECT lane FROM jobs WHERE id = %s", (job_id,)).fetchone()
        packed = conn.execute("SELECT count(*) FROM batch_jobs WHERE job_id = %s",
                              (job_id,)).fetchone()
    assert lane == ("batch",)
    assert packed == (1,)


def test_cli_lag_and_health_read_the_secured_stack(secured: StackState) -> None:
    """`calmq lag` and `calmq health` reach Kafka and the registry with the settings alone,
    and `calmq dev status` reports every part of the secured stack healthy."""
    env = {**secured.env, "CALMQ_RETRY_TIERS": "1s,5s"}  # the tiers the stack was made with
    lag = _calmq(env, "lag", "-o", "json")
    assert lag.returncode == 0, lag.stderr
    rows = json.loads(lag.stdout)
    assert {r["topic"] for r in rows} >= {"calmq.default.interactive", "calmq.default.bulk"}
    health = _calmq(env, "health", "-o", "json")
    assert health.returncode == 0, health.stdout + health.stderr
    parts = {r["part"]: r for r in json.loads(health.stdout)}
    assert parts["kafka"]["status"] == "up"
    assert parts["schema-registry"]["status"] == "up"
    status = _calmq(env, "dev", "status", "--data-dir", secured.data_dir, "-o", "json")
    assert status.returncode == 0, status.stdout  # every part of the secured stack healthy


@pytest.mark.parametrize(("drop", "code", "named"), [
    (_SECURITY_KEYS, "kafka_security_mismatch", "CALMQ_KAFKA_SECURITY_PROTOCOL"),
    (("CALMQ_KAFKA_SSL_CA_LOCATION",), "kafka_tls_untrusted", "CALMQ_KAFKA_SSL_CA_LOCATION"),
])
def test_a_client_without_the_security_settings_gets_an_error_naming_them(
        secured: StackState, drop: tuple[str, ...], code: str, named: str) -> None:
    """Without the security settings (or the CA) `calmq lag` fails within seconds with one
    line naming the setting, and a worker exits at start instead of retrying forever."""
    env = {k: v for k, v in secured.env.items() if k not in drop}
    lag = _calmq(env, "lag")
    assert lag.returncode != 0
    assert f"[{code}]" in lag.stderr
    assert named in lag.stderr
    assert "Traceback" not in lag.stderr
    worker = _calmq(env, "worker", "--pool", "default")
    assert worker.returncode != 0
    assert named in worker.stderr


def test_wrong_credentials_are_named_for_kafka_and_the_registry(secured: StackState,
                                                                tmp_path: Path) -> None:
    """A wrong SASL password and a wrong registry password each give their own error."""
    wrong = tmp_path / "wrong"
    wrong.write_text("not-the-password")
    env = {**secured.env, "CALMQ_KAFKA_SASL_PASSWORD_FILE": str(wrong)}
    lag = _calmq(env, "lag")
    assert "[kafka_authentication_failed]" in lag.stderr
    assert "CALMQ_KAFKA_SASL_PASSWORD" in lag.stderr
    env = {**secured.env, "CALMQ_SCHEMA_REGISTRY_PASSWORD_FILE": str(wrong)}
    register = _calmq(env, "schemas", "register")
    assert "[registry_authentication_failed]" in register.stderr
    assert urlparse(secured.env["CALMQ_SCHEMA_REGISTRY_URL"]).netloc in register.stderr


def test_a_stack_on_an_external_secured_broker_reads_its_file_secrets(
        secured: StackState, tmp_path: Path) -> None:
    """`calmq dev up` against an external SASL_SSL broker and registry whose passwords are
    given as *_FILE settings starts: its own clients (topics, schemas) read those files
    instead of failing with kafka_credentials_missing."""
    external = {k: v for k, v in secured.env.items()
                if k.startswith(("CALMQ_KAFKA_", "CALMQ_SCHEMA_REGISTRY_", "CALMQ_DATABASE_"))}
    assert "CALMQ_KAFKA_SASL_PASSWORD_FILE" in external
    assert "CALMQ_SCHEMA_REGISTRY_PASSWORD_FILE" in external
    stack = Stack(tmp_path / "on-external", environ=external)
    try:
        state = stack.up(services=(), log=lambda _m: None)
        assert state.env["CALMQ_KAFKA_BOOTSTRAP"] == secured.env["CALMQ_KAFKA_BOOTSTRAP"]
        assert {p.name: p.pid for p in state.parts}["kafka"] is None  # not started here
    finally:
        stack.down(log=lambda _m: None)
