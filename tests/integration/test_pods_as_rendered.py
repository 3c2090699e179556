"""Pods as rendered: every container of the Helm chart's output, run as a local process.

The values come the way a team with its own workflow module makes them: `calmq k8s values`
with the module and the settings (the pools and their grace periods, KEDA's numbers, the
ConfigMap's settings), then ``helm template`` of deploy/helm/calmq with that file (and the
console on a port of its own). tests/unit/test_chart.py holds `calmq k8s render` to the same
objects.

No cluster here, so the kubelet's part is played by this test: it runs the hook Jobs in
their weight order, then every Deployment's containers, each with the exact ``command`` +
``args`` and the environment built the way Kubernetes does (``envFrom`` the ConfigMap, then
the container's ``env`` in order, a ``secretKeyRef`` read from the Secrets). Only what a
cluster's network provides is mapped:

- in-cluster names to the session stack's addresses (``kafka:9092`` -> its broker, the
  schema registry, the provider URL -> a fake provider of this test, ``s3://`` -> a
  ``file://`` store, the stack having no S3), the Secrets' values to this test's database;
- each pod's own ports (every pod has its own network namespace; here they share one), so a
  declared ``containerPort`` becomes a free local port in the args/env that name it.

The set runs against its own database on the stack's PostgreSQL server, its own pools
(tests/support/k8s_workflows.py, loaded through the ConfigMap), retry tiers and replication
slot, so it never shares work with the stack's own services.

A second set is rendered with credentials, from the settings of the secured stack
(tests/integration/conftest.py, shared with test_secured_stack.py): a broker with only a
SASL_SSL listener and a registry behind HTTPS and basic auth. The Secret ``calmq`` is made
with exactly the keys its rendered template lists; the kubelet's part grows by the Secret
volumes: each mounted key is written as a file (with the volume's mode) in a folder that
stands in for the mount path, and a setting naming a file under that path names the file
there. KEDA's part is played too: the pool's TriggerAuthentication is resolved as KEDA's
operator resolves it and handed to a model of its Kafka scaler (tests/support/keda_auth.py),
which must read the pool's lag from the secured broker.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse, urlunparse

import psycopg
import pytest
import yaml

from calmq.tooling.devstack import StackState, processes
from calmq.tooling.kubernetes import secret_template
from tests.support.api import Api
from tests.support.k8s_tools import tool
from tests.support.k8s_workflows import POOL_A, POOL_B, WORKFLOW_A, WORKFLOW_B
from tests.support.waiting import wait_for
from tests.support.workers import create_tenant_id

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
SETTINGS = ROOT / "deploy" / "kubernetes" / "settings.yaml"
CHART = ROOT / "deploy" / "helm" / "calmq"
# Inputs of ~4,000 characters: the fake provider counts a token per 4 characters, so a call
# costs ~1,000 prompt tokens (+ at most max_tokens 256, which the budget reserves at
# admission and settles with the real usage). The prompt dominates, so whichever the budget
# counts, ~60 calls a minute fit: the fleet may start about one call a second.
TEXT = "a pod as rendered runs the exact command of its container. " * 68
TOKENS_PER_CALL = len(TEXT) // 4  # the least a call costs
BUDGET = 60 * (TOKENS_PER_CALL + 256)
JOBS_A, JOBS_B = 10, 4  # pool B's jobs fail once (503) and come back through the forwarder
CONSOLE_PORT = 8081
TIERS = "3s,9s"
TERMINAL = ("completed", "dead_letter", "cancelled")


def _host_ip() -> str | None:
    """This machine's first non-loopback IPv4 address, if it has one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.255", 9))  # no packet is sent: it only picks the route
            ip = str(s.getsockname()[0])
        except OSError:
            return None
    return None if ip.startswith("127.") else ip


def _get(url: str, timeout: float = 3) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status), resp.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        return exc.code, ""
    except OSError:
        return 0, ""


@dataclass
class Pod:
    """One container of a rendered manifest, mapped to a local process."""

    owner: str  # Deployment or Job name
    container: dict[str, Any]
    ports: dict[str, int]  # declared port name -> local port
    argv: list[str]
    env: dict[str, str]
    pid: int | None = None
    log: Path | None = None
    probes: list[tuple[str, str, int]] = field(default_factory=list)  # (kind, path, port)


class Kubelet:
    """Builds and runs the pods of one rendered folder against the local stack."""

    def __init__(self, manifests: list[dict[str, Any]], mapping: dict[str, str],
                 secrets: dict[tuple[str, str], str], logs: Path) -> None:
        self.manifests = manifests
        self.mapping = mapping
        self.secrets = secrets
        self.logs = logs
        [config] = [m for m in self.manifests if m["kind"] == "ConfigMap"]
        self.config: dict[str, str] = config["data"]
        self.started: list[Pod] = []
        self.mounted: dict[str, str] = {}  # a Secret volume's files: local path -> text

    def _map(self, value: str) -> str:
        for cluster, local in self.mapping.items():
            value = value.replace(cluster, local)
        return value

    def pods(self, kind: str) -> list[Pod]:
        """Every container of every ``kind`` object; hook Jobs in their weight order."""
        out = []
        objects = [m for m in self.manifests if m["kind"] == kind]
        objects.sort(key=lambda m: int((m["metadata"].get("annotations") or {}).get(
            "helm.sh/hook-weight", "0")))
        for m in objects:
            spec = m["spec"]["template"]["spec"]
            for c in spec["containers"]:
                out.append(self.pod(m["metadata"]["name"], c, spec))
        return out

    def _mount(self, owner: str, container: dict[str, Any], spec: dict[str, Any]
               ) -> dict[str, str]:
        """Each Secret volume the container mounts, written as the kubelet writes it: the
        listed keys of the Secret as files (with the volume's mode) in a folder standing in
        for the mount path. Returns mount path -> that folder. A key the Secret lacks fails
        the pod, as it would keep a real one from starting."""
        volumes = {v["name"]: v for v in spec.get("volumes", [])}
        folders: dict[str, str] = {}
        for mount in container.get("volumeMounts", []):
            secret = volumes[mount["name"]].get("secret")
            if secret is None:
                continue  # the emptyDir at /tmp: the process's own /tmp stands in for it
            folder = self.logs.parent / "volumes" / owner / container["name"] / mount["name"]
            folder.mkdir(parents=True, exist_ok=True)
            for item in secret["items"]:
                text = self.secrets[(secret["secretName"], item["key"])]
                path = folder / item["path"]
                path.write_text(text)
                path.chmod(secret.get("defaultMode", 0o644))
                self.mounted[str(path)] = text
            folders[mount["mountPath"]] = str(folder)
        return folders

    def pod(self, owner: str, container: dict[str, Any], spec: dict[str, Any]) -> Pod:
        folders = self._mount(owner, container, spec)
        env = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
        for ref in container.get("envFrom", []):
            assert ref == {"configMapRef": {"name": "calmq"}}, ref
            env.update(self.config)
        for item in container.get("env", []):
            if "valueFrom" in item:
                ref = item["valueFrom"]["secretKeyRef"]
                env[item["name"]] = self.secrets[(ref["name"], ref["key"])]
            else:
                env[item["name"]] = item["value"]
        env = {k: self._map(v) if k.startswith("CALMQ_") else v for k, v in env.items()}
        for key, value in env.items():  # a path into a mounted volume: its local folder
            for mount_path, folder in folders.items():
                if key.startswith("CALMQ_") and value.startswith(mount_path + "/"):
                    env[key] = folder + value[len(mount_path):]
        env["PYTHONUNBUFFERED"] = "1"
        ports = {p["name"]: processes.free_port() for p in container.get("ports", [])}
        declared = {str(p["containerPort"]): str(ports[p["name"]])
                    for p in container.get("ports", [])}
        args = [declared.get(a, a) for a in container["args"]]
        for key, value in env.items():
            if key.startswith("CALMQ_") and key.endswith("_PORT") and value in declared:
                env[key] = declared[value]
        # The image's `calmq` is the console script of calmq.cli:main.
        assert container["command"] == ["calmq"]
        argv = [sys.executable, "-m", "calmq.cli", *args]
        probes = [(kind, container[kind]["httpGet"]["path"],
                   ports[container[kind]["httpGet"]["port"]])
                  for kind in ("startupProbe", "livenessProbe", "readinessProbe")
                  if kind in container]
        return Pod(owner, container, ports, argv, env, probes=probes)

    def run_to_end(self, pod: Pod, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(pod.argv, env=pod.env, cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, check=False)

    def start(self, pod: Pod) -> Pod:
        pod.log = self.logs / f"{pod.owner}-{pod.container['name']}.log"
        pod.pid = processes.start(pod.argv, pod.log, env=pod.env, cwd=ROOT)
        self.started.append(pod)
        return pod

    def stop_all(self) -> None:
        for pod in reversed(self.started):
            if pod.pid is not None:
                processes.stop(pod.pid, timeout=30)


def _render(tmp: Path, settings: dict[str, str]) -> list[dict[str, Any]]:
    """`calmq k8s values` for the settings, then `helm template` with it: the objects."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
    env.update(settings)
    values = tmp / "values.yaml"
    made = subprocess.run([sys.executable, "-m", "calmq.cli", "k8s", "values", "--settings",
                           str(SETTINGS)], env=env, cwd=ROOT, check=True, capture_output=True,
                          text=True, timeout=60)
    values.write_text(made.stdout)
    own = tmp / "console.yaml"
    own.write_text(yaml.safe_dump({"api": {"console": {"port": CONSOLE_PORT}}}))
    # A cluster with KEDA (the chart refuses ScaledObjects a cluster cannot take).
    done = subprocess.run([tool("helm"), "template", "calmq", str(CHART), "--namespace",
                           "calmq", "--api-versions", "keda.sh/v1alpha1", "--skip-tests",
                           "-f", str(values), "-f", str(own)],
                          env={k: v for k, v in env.items() if not k.startswith("CALMQ_")},
                          cwd=ROOT, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _database(stack_url: str, name: str) -> str:
    with psycopg.connect(stack_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')  # a name this test made: no injection
    parsed = urlparse(stack_url)
    return urlunparse(parsed._replace(path="/" + name))


def _drop_database(stack_url: str, name: str, slot: str) -> None:
    with psycopg.connect(stack_url, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots"
                     " WHERE slot_name = %s AND NOT active", (slot,))
        conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def _usage(pid: int) -> tuple[float, float]:
    """(peak RSS in MiB, CPU seconds) of a running process, from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    hwm = int(re.search(r"VmHWM:\s+(\d+) kB", status).group(1))  # type: ignore[union-attr]
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return hwm / 1024, (int(fields[11]) + int(fields[12])) / ticks


def _mebibytes(quantity: str) -> float:
    units = {"Ki": 1 / 1024, "Mi": 1.0, "Gi": 1024.0}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return float(quantity[: -len(suffix)]) * factor
    return float(quantity) / (1 << 20)


@dataclass
class RenderedSet:
    kubelet: Kubelet
    api: Api
    db: str
    provider_url: str
    host_ip: str | None
    notes: list[str]


@pytest.fixture(scope="module")
def rendered_set(stack: StackState) -> Iterator[RenderedSet]:
    """Render with the test's values, then run every Job to its end and every Deployment."""
    tmp = Path(tempfile.mkdtemp(prefix="calmq-pods-"))
    suffix = uuid.uuid4().hex[:8]
    db_name, slot = f"calmq_k8s_{suffix}", f"calmq_k8s_{suffix}"
    stack_db = stack.env["CALMQ_DATABASE_URL"]
    db = _database(stack_db, db_name)
    fake_port = processes.free_port()
    fake_pid = processes.start(
        [sys.executable, "-m", "calmq.cli", "fake-provider", "--port", str(fake_port)],
        tmp / "fake-provider.log", cwd=ROOT)
    provider_url = f"http://127.0.0.1:{fake_port}"
    kubelet: Kubelet | None = None
    try:
        manifests = _render(tmp, {
            "CALMQ_WORKFLOW_MODULES": "tests.support.k8s_workflows",
            "CALMQ_KEDA_POOLS": f"{POOL_A},{POOL_B}",
            "CALMQ_BUDGET_TOKENS_PER_MINUTE": str(BUDGET),
            "CALMQ_RETRY_TIERS": TIERS, "CALMQ_RETRY_INITIAL_SECONDS": "0.5",
            "CALMQ_RELAY_SLOT": slot, "CALMQ_TOPIC_REPLICATION": "1",
            "CALMQ_TOPIC_PARTITIONS": "2", "CALMQ_LEASE_SECONDS": "5",
        })
        objects = tmp / "objects"
        objects.mkdir()
        [config] = [m["data"] for m in manifests if m["kind"] == "ConfigMap"]
        mapping = {
            config["CALMQ_KAFKA_BOOTSTRAP"]: stack.env["CALMQ_KAFKA_BOOTSTRAP"],
            config["CALMQ_SCHEMA_REGISTRY_URL"]: stack.env["CALMQ_SCHEMA_REGISTRY_URL"],
            config["CALMQ_OBJECT_STORE_URL"]: objects.as_uri(),
            config["CALMQ_PROVIDER_URL"]: provider_url,
        }
        # The Secret as `kubectl create secret` would hold it (the keys the values read).
        secrets = {("calmq", "CALMQ_DATABASE_URL"): db,
                   ("calmq", "CALMQ_PROVIDER_API_KEY"): "test-key"}
        kubelet = Kubelet(manifests, mapping, secrets, tmp / "logs")
        wait_for(lambda: processes.port_open("127.0.0.1", fake_port), timeout=30,
                 what="the test's fake provider")
        notes = _run_jobs(kubelet)
        for pod in kubelet.pods("Deployment"):
            kubelet.start(pod)
        api_pod = next(p for p in kubelet.started if p.owner == "calmq-api")
        for pod in kubelet.started:
            _wait_probes(pod)
        _tenant, key = create_tenant_id(db, f"k8s-{suffix}")
        api = Api(f"http://127.0.0.1:{api_pod.ports['http']}", key)
        yield RenderedSet(kubelet, api, db, provider_url, _host_ip(), notes)
    finally:
        if kubelet is not None:
            kubelet.stop_all()
        processes.stop(fake_pid)
        _drop_database(stack_db, db_name, slot)


def _run_jobs(kubelet: Kubelet) -> list[str]:
    """Each Job's containers to completion, as the kubelet would before the rest starts."""
    notes = []
    jobs = kubelet.pods("Job")
    assert jobs[0].owner == "calmq-migrate"  # the lowest hook weight: first
    for pod in jobs:
        result = kubelet.run_to_end(pod)
        assert result.returncode == 0, (pod.owner, pod.argv, result.stdout, result.stderr)
        notes.append(f"{pod.owner}/{pod.container['name']}: ran")
    return notes


def _wait_probes(pod: Pod) -> None:
    """The startup probe passes within its budget, then liveness and readiness answer 200."""
    assert pod.pid is not None
    startup = pod.container.get("startupProbe")
    budget = (startup["periodSeconds"] * startup["failureThreshold"]) if startup else 60

    def answered() -> bool:
        assert processes.is_alive(pod.pid or 0), \
            f"{pod.owner} exited: {pod.log.read_text()[-3000:] if pod.log else ''}"
        return all(_get(f"http://127.0.0.1:{port}{path}")[0] == 200
                   for _kind, path, port in pod.probes)

    wait_for(answered, timeout=budget, what=f"the probes of {pod.owner}")


def _job_status(api: Api, job_id: str) -> str:
    return str(api.job(job_id)["status"])


def test_every_pod_answers_its_probes_on_a_non_loopback_address(
    rendered_set: RenderedSet,
) -> None:
    """Each Deployment's process serves its probes, and /metrics from outside loopback."""
    started = {p.owner for p in rendered_set.kubelet.started}
    assert started == {"calmq-api", "calmq-relay", "calmq-forwarder", "calmq-reaper",
                       f"calmq-worker-{POOL_A}", f"calmq-worker-{POOL_B}",
                       f"calmq-batcher-{POOL_A}", f"calmq-batcher-{POOL_B}"}
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True,
                               check=False).stdout
    for pod in rendered_set.kubelet.started:
        assert pod.probes, pod.owner
        for _kind, path, port in pod.probes:
            assert _get(f"http://127.0.0.1:{port}{path}")[0] == 200, (pod.owner, path)
        port = pod.ports["metrics"]  # what the scrape annotations and PodMonitors name
        if rendered_set.host_ip:  # what Prometheus does: scrape the pod's IP
            status, text = _get(f"http://{rendered_set.host_ip}:{port}/metrics")
            assert status == 200, pod.owner
            assert "# TYPE" in text, pod.owner
        else:  # no non-loopback address here: the socket is bound to every interface
            assert re.search(rf"(0\.0\.0\.0|\*|\[::\]):{port}\b", listening), pod.owner


def test_the_api_serves_metrics_and_the_console_on_their_own_ports(
    rendered_set: RenderedSet,
) -> None:
    """The API pod: /metrics on its metrics port and not on the API's, the console on its
    own port and not on the API's (what a NetworkPolicy and an Ingress need)."""
    api = next(p for p in rendered_set.kubelet.started if p.owner == "calmq-api")
    assert set(api.ports) == {"http", "metrics", "console"}
    http, metrics, console = api.ports["http"], api.ports["metrics"], api.ports["console"]
    assert _get(f"http://127.0.0.1:{http}/metrics")[0] == 404
    status, text = _get(f"http://127.0.0.1:{metrics}/metrics")
    assert status == 200
    assert "calmq_" in text
    assert _get(f"http://127.0.0.1:{http}/console")[0] == 404
    assert _get(f"http://127.0.0.1:{console}/console")[0] in (200, 302, 303, 401)
    assert _get(f"http://127.0.0.1:{http}/healthz")[0] == 200


def test_jobs_flow_through_the_rendered_set_under_the_fleet_budget(
    rendered_set: RenderedSet,
) -> None:
    """Jobs of both module pools complete (pool B's after a retry through the forwarder),
    and the workers hold the fleet to the ConfigMap's token budget: the calls are spread
    at its rate, and calls waited for budget."""
    api = rendered_set.api
    started = time.monotonic()
    ids_a = [api.submit({"text": f"{i} {TEXT}"}, workflow=WORKFLOW_A) for i in range(JOBS_A)]
    ids_b = [api.submit({"text": f"{i} {TEXT}", "mode": "flaky", "fail_times": 1},
                        workflow=WORKFLOW_B) for i in range(JOBS_B)]
    ids = ids_a + ids_b
    wait_for(lambda: all(_job_status(api, j) in TERMINAL for j in ids), timeout=120,
             what="every job of the rendered set to finish")
    elapsed = time.monotonic() - started
    assert {j: _job_status(api, j) for j in ids} == dict.fromkeys(ids, "completed")
    for job_id in ids_b:  # the retry went through a tier topic and the forwarder
        types = [e["type"] for e in api.job(job_id)["events"]]
        assert "retry_scheduled" in types, types

    # Pool A's jobs (pool B's wait 3 s for their retry tier anyway): ~1,000 tokens each at
    # ~60 calls a minute (less the interactive share these bulk jobs may not use) finish
    # under one a second after a burst of a second or two; unbudgeted, they would all
    # finish within a second (they start within 1.5 s of each other). Completion times, not
    # 'running' (an attempt is running from its claim; the budget wait is inside it).
    with psycopg.connect(rendered_set.db) as conn:
        row = conn.execute(
            "SELECT extract(epoch FROM max(at) - min(at)) FROM job_events"
            " WHERE type = 'completed' AND job_id = ANY(%s::uuid[])", (ids_a,)).fetchone()
        first = conn.execute(
            "SELECT extract(epoch FROM max(at) - min(at)) FROM job_events"
            " WHERE type IN ('running', 'completed')").fetchone()
    assert row is not None
    assert first is not None
    spread_a, spread = float(row[0]), float(first[0])
    tokens = sum(view["usage"]["input_tokens"] + view["usage"]["output_tokens"]
                 for view in (api.job(j) for j in ids))
    rate = BUDGET / 60  # tokens a second
    print(f"pool A: {JOBS_A} calls over {spread_a:.1f} s; all: {tokens} tokens "
          f"over {spread:.1f} s, budget {rate:.0f} tokens/s")
    assert spread_a >= 0.5 * (JOBS_A - 2) * TOKENS_PER_CALL / rate, spread_a
    # Never more than the budget: the tokens spent fit its rate over the time the calls
    # took, plus the bucket (1 s) and the slices the two workers leased ahead (0.25 s each).
    assert tokens <= rate * (spread + 1.5) + 2 * (TOKENS_PER_CALL + 256), (tokens, spread)
    assert elapsed >= spread
    with urllib.request.urlopen(rendered_set.provider_url + "/stats", timeout=5) as resp:
        stats = json.loads(resp.read())
    assert stats["status_counts"].get("429", 0) == 0
    waited = 0.0
    for pod in rendered_set.kubelet.started:
        if pod.owner.startswith("calmq-worker-"):
            _status, text = _get(f"http://127.0.0.1:{pod.ports['metrics']}/metrics")
            waited += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                          if line.startswith("calmq_budget_wait_seconds_sum"))
    assert waited > 1.0, "no call waited for the fleet budget"


def test_processes_stay_within_their_rendered_memory_limits(rendered_set: RenderedSet) -> None:
    """Peak RSS of every part is below the memory limit rendered for it (figures printed
    for docs/how-to/deploy-kubernetes.md)."""
    figures = {}
    for pod in rendered_set.kubelet.started:
        assert pod.pid is not None
        rss, cpu = _usage(pod.pid)
        limit = _mebibytes(pod.container["resources"]["limits"]["memory"])
        request = _mebibytes(pod.container["resources"]["requests"]["memory"])
        figures[pod.owner] = {"peak_rss_mib": round(rss, 1), "cpu_s": round(cpu, 2),
                              "request_mib": request, "limit_mib": limit}
        assert rss < limit, (pod.owner, rss, limit)
    print(json.dumps(figures, indent=1))
    out = os.environ.get("CALMQ_TEST_FIGURES")
    if out:
        Path(out).write_text(json.dumps(figures, indent=1))


def test_api_starts_with_kubernetes_service_links(stack: StackState, tmp_path: Path) -> None:
    """`calmq api` with CALMQ_API_SERVICE_HOST, CALMQ_API_PORT=tcp://... and the rest of
    what a Service named calmq-api injects starts, serves, and names the cause in its log."""
    port = processes.free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CALMQ_")}
    env.update(stack.env)
    env.update({
        "CALMQ_API_SERVICE_HOST": "10.0.0.1", "CALMQ_API_SERVICE_PORT": "8080",
        "CALMQ_API_SERVICE_PORT_HTTP": "8080", "CALMQ_API_PORT": "tcp://10.0.0.1:8080",
        "CALMQ_API_PORT_8080_TCP": "tcp://10.0.0.1:8080",
        "CALMQ_API_PORT_8080_TCP_PROTO": "tcp", "CALMQ_API_PORT_8080_TCP_PORT": "8080",
        "CALMQ_API_PORT_8080_TCP_ADDR": "10.0.0.1", "PYTHONUNBUFFERED": "1",
    })
    log = tmp_path / "api.log"
    pid = processes.start([sys.executable, "-m", "calmq.cli", "api", "--api-port", str(port)],
                          log, env=env, cwd=ROOT)
    try:
        wait_for(lambda: not processes.is_alive(pid)
                 or _get(f"http://127.0.0.1:{port}/healthz")[0] == 200,
                 timeout=30, what="the API started with service links")
        assert processes.is_alive(pid), log.read_text()
        assert _get(f"http://127.0.0.1:{port}/readyz")[0] == 200
        text = log.read_text()
        assert "Kubernetes service links" in text
        assert "enableServiceLinks: false" in text
    finally:
        processes.stop(pid)


def test_dev_stack_keeps_metrics_on_loopback(stack: StackState) -> None:
    """`calmq dev up` sets CALMQ_METRICS_HOST=127.0.0.1: its parts' /metrics sockets listen
    on loopback only, while the setting's default (all interfaces) is what pods get."""
    listening = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True,
                               check=True).stdout.split()
    for part in stack.parts:
        if part.name not in ("relay", "worker", "forwarder"):
            continue
        port = urlparse(part.address).port
        assert f"127.0.0.1:{port}" in listening, part.name
        assert f"0.0.0.0:{port}" not in listening, part.name
        assert f"*:{port}" not in listening, part.name


# -- the same pods against a SASL_SSL-only broker and a registry behind HTTPS and basic auth --

SECURED_JOBS = 3
SECURED_TIERS = "2s,7s"  # none of the secured stack's own (1s,5s): its forwarder stays apart


def _security_settings(env: dict[str, str]) -> dict[str, str]:
    """How the secured stack is reached, as an operator's shell holds it: the protocol, SASL
    mechanism and user, the passwords as files (CALMQ_*_PASSWORD_FILE), the CAs as paths."""
    return {k: v for k, v in env.items()
            if k.startswith(("CALMQ_KAFKA_S", "CALMQ_SCHEMA_REGISTRY_"))
            and k != "CALMQ_SCHEMA_REGISTRY_URL"}


@dataclass
class SecuredSet:
    kubelet: Kubelet
    api: Api
    manifests: list[dict[str, Any]]
    secret: dict[str, str]  # the Secret calmq, key -> value, as the operator created it
    bootstrap: str  # the broker's address (the ConfigMap's in-cluster name maps to it)
    text: str  # the values `calmq k8s values` wrote, and the objects `helm template` made


@pytest.fixture(scope="module")
def secured_set(secured_stack: StackState) -> Iterator[SecuredSet]:
    """`calmq k8s values` from the secured stack's Kafka and registry settings, `helm
    template`, the Secret ``calmq`` made with exactly the keys its template lists (from the
    password files and the CA), then the Jobs to their end and every Deployment, each
    against the secured stack alone."""
    env = secured_stack.env
    tmp = Path(tempfile.mkdtemp(prefix="calmq-pods-secured-"))
    suffix = uuid.uuid4().hex[:8]
    name = f"calmq_k8s_sec_{suffix}"
    db = _database(env["CALMQ_DATABASE_URL"], name)
    kubelet: Kubelet | None = None
    try:
        manifests = _render(tmp, {
            **_security_settings(env),
            "CALMQ_WORKFLOW_MODULES": "tests.support.k8s_workflows", "CALMQ_KEDA_POOLS": POOL_A,
            "CALMQ_RETRY_TIERS": SECURED_TIERS, "CALMQ_RELAY_SLOT": name,
            "CALMQ_TOPIC_REPLICATION": "1", "CALMQ_TOPIC_PARTITIONS": "2",
            "CALMQ_BUDGET_TOKENS_PER_MINUTE": "0"})
        values = yaml.safe_load((tmp / "values.yaml").read_text())
        template = secret_template(values, "calmq")
        # What `kubectl create secret generic calmq --from-literal=... --from-file=...` holds.
        secret = {
            "CALMQ_DATABASE_URL": db, "CALMQ_PROVIDER_API_KEY": "test-key",
            "CALMQ_KAFKA_SASL_PASSWORD": Path(env["CALMQ_KAFKA_SASL_PASSWORD_FILE"]).read_text(),
            "CALMQ_SCHEMA_REGISTRY_PASSWORD":
                Path(env["CALMQ_SCHEMA_REGISTRY_PASSWORD_FILE"]).read_text(),
            "kafka-ca.pem": Path(env["CALMQ_KAFKA_SSL_CA_LOCATION"]).read_text(),
            "registry-ca.pem": Path(env["CALMQ_SCHEMA_REGISTRY_CA_LOCATION"]).read_text()}
        assert sorted(template["stringData"]) == sorted(secret)
        objects = tmp / "objects"
        objects.mkdir()
        [config] = [m["data"] for m in manifests if m["kind"] == "ConfigMap"]
        mapping = {
            config["CALMQ_KAFKA_BOOTSTRAP"]: env["CALMQ_KAFKA_BOOTSTRAP"],
            config["CALMQ_SCHEMA_REGISTRY_URL"]: env["CALMQ_SCHEMA_REGISTRY_URL"],
            config["CALMQ_OBJECT_STORE_URL"]: objects.as_uri(),
            config["CALMQ_PROVIDER_URL"]: env["CALMQ_FAKE_PROVIDER_URL"],
        }
        kubelet = Kubelet(manifests, mapping, {("calmq", k): v for k, v in secret.items()},
                          tmp / "logs")
        _run_jobs(kubelet)
        for pod in kubelet.pods("Deployment"):
            kubelet.start(pod)
        for pod in kubelet.started:
            _wait_probes(pod)
        _tenant, key = create_tenant_id(db, f"k8s-sec-{suffix}")
        api_pod = next(p for p in kubelet.started if p.owner == "calmq-api")
        yield SecuredSet(kubelet, Api(f"http://127.0.0.1:{api_pod.ports['http']}", key),
                         manifests, secret, env["CALMQ_KAFKA_BOOTSTRAP"],
                         (tmp / "values.yaml").read_text() + yaml.safe_dump_all(manifests))
    finally:
        if kubelet is not None:
            kubelet.stop_all()
        _drop_database(env["CALMQ_DATABASE_URL"], name, name)


def test_rendered_pods_run_jobs_through_a_sasl_ssl_broker_and_an_authenticated_registry(
        secured_set: SecuredSet) -> None:
    """With the credentials in the Secret alone (never in a rendered object), the hook Jobs
    made the topics and registered the schemas over SASL_SSL and HTTPS, every Deployment
    serves its probes, the CAs are the mounted Secret files, and jobs complete."""
    kubelet = secured_set.kubelet
    assert {p.owner for p in kubelet.started} == {
        "calmq-api", "calmq-relay", "calmq-forwarder", "calmq-reaper",
        f"calmq-worker-{POOL_A}", f"calmq-batcher-{POOL_A}"}
    for key in ("CALMQ_KAFKA_SASL_PASSWORD", "CALMQ_SCHEMA_REGISTRY_PASSWORD"):
        assert secured_set.secret[key] not in secured_set.text
    worker = next(p for p in kubelet.started if p.owner == f"calmq-worker-{POOL_A}")
    assert worker.env["CALMQ_KAFKA_SECURITY_PROTOCOL"] == "SASL_SSL"
    for setting, key in (("CALMQ_KAFKA_SSL_CA_LOCATION", "kafka-ca.pem"),
                         ("CALMQ_SCHEMA_REGISTRY_CA_LOCATION", "registry-ca.pem")):
        assert kubelet.mounted[worker.env[setting]] == secured_set.secret[key]
    api = secured_set.api
    ids = [api.submit({"text": f"{i} secured pods"}, workflow=WORKFLOW_A)
           for i in range(SECURED_JOBS)]
    wait_for(lambda: all(_job_status(api, j) in TERMINAL for j in ids), timeout=90,
             what="the jobs of the secured set to finish")
    assert {j: _job_status(api, j) for j in ids} == dict.fromkeys(ids, "completed")


def test_keda_reads_the_pools_lag_with_its_trigger_authentication(
        secured_set: SecuredSet) -> None:
    """KEDA's Kafka scaler, given what the pool's ScaledObject and TriggerAuthentication
    resolve to (the Secret's keys, the worker's variables), reaches the SASL_SSL broker and
    reads the pool's lag: offsets committed, and none left once a job has completed."""
    from confluent_kafka import Consumer, TopicPartition

    from tests.support.keda_auth import (
        librdkafka_config,
        parse_kafka_auth,
        resolve_auth_params,
    )

    api = secured_set.api
    job = api.submit({"text": "counted by KEDA"}, workflow=WORKFLOW_A)
    wait_for(lambda: _job_status(api, job) in TERMINAL, timeout=60, what="the job")
    by_kind = {(m["kind"], m["metadata"]["name"]): m for m in secured_set.manifests}
    name = f"calmq-worker-{POOL_A}"
    [trigger] = by_kind[("ScaledObject", name)]["spec"]["triggers"]
    assert trigger["authenticationRef"] == {"name": name}
    spec = by_kind[("TriggerAuthentication", name)]["spec"]
    worker = next(p for p in secured_set.kubelet.started if p.owner == name)
    params = resolve_auth_params(spec, {("calmq", k): v for k, v in secured_set.secret.items()},
                                 {"worker": worker.env})
    auth = parse_kafka_auth(trigger["metadata"], params, spec.get("podIdentity"))
    assert (auth.sasl, auth.tls) == ("scram_sha512", True)
    config = librdkafka_config(trigger["metadata"]["bootstrapServers"].replace(
        "kafka:9092", secured_set.bootstrap), auth)
    consumer = Consumer({**config, "group.id": trigger["metadata"]["consumerGroup"],
                         "enable.auto.commit": False})
    try:
        topics = [f"calmq.{POOL_A}.interactive", f"calmq.{POOL_A}.bulk"]
        meta = consumer.list_topics(timeout=10)
        partitions = [TopicPartition(t, p) for t in topics for p in meta.topics[t].partitions]

        def lag() -> int | None:
            committed = consumer.committed(partitions, timeout=10)
            if all(tp.offset < 0 for tp in committed):
                return None  # nothing committed yet
            total = 0
            for tp in committed:  # offsetResetPolicy earliest: no commit lags by the end
                _low, high = consumer.get_watermark_offsets(tp, timeout=10)
                total += high - max(tp.offset, 0)
            return total

        wait_for(lambda: lag() == 0, timeout=30, what="the pool's lag, read as KEDA reads it")
    finally:
        consumer.close()
