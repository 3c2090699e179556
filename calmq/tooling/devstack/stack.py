"""The local stack behind `calmq dev up|down|status|env`, also used by the test fixtures.

Everything it starts is a child process whose pid is written to ``<data dir>/stack.json``
as soon as it exists, so ``down`` stops exactly what ``up`` started even after a failed
``up``. External services named by ``CALMQ_DATABASE_URL``, ``CALMQ_KAFKA_BOOTSTRAP`` or
``CALMQ_SCHEMA_REGISTRY_URL`` are used instead of starting our own.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from calmq import topics
from calmq.errors import ConfigError, InfrastructureError
from calmq.settings import Settings
from calmq.tooling.devstack import kafka, postgres, processes, registry

__all__ = ["SERVICES", "Part", "Stack", "default_data_dir"]

SERVICES = ("fake-provider", "api", "relay", "worker", "forwarder", "batcher")
_STATE = "stack.json"


def default_data_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"calmq-dev-{os.getuid()}"


@dataclass
class Part:
    name: str
    pid: int | None  # None: an external service we did not start
    address: str
    kind: str  # postgres | kafka | http

    def healthy(self) -> bool:
        if self.pid is not None and not processes.is_alive(self.pid):
            return False
        if self.kind in ("http", "registry"):
            probe = "/healthz" if self.kind == "http" else "/subjects"
            try:
                with urllib.request.urlopen(self.address + probe, timeout=1) as resp:  # noqa: S310
                    return bool(resp.status == 200)
            except OSError:
                return False
        parsed = urlparse(self.address if "://" in self.address else f"tcp://{self.address}")
        return processes.port_open(parsed.hostname or "127.0.0.1", parsed.port or 0)


@dataclass
class StackState:
    data_dir: str
    parts: list[Part] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    versions: dict[str, str] = field(default_factory=dict)
    ready_seconds: float | None = None

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> StackState:
        raw = json.loads(text)
        raw["parts"] = [Part(**p) for p in raw["parts"]]
        return cls(**raw)


class Stack:
    """Start, inspect and stop the local stack kept under ``data_dir``."""

    def __init__(self, data_dir: Path, environ: Mapping[str, str] | None = None, *,
                 postgres_settings: Mapping[str, str] | None = None) -> None:
        self.data_dir = data_dir.resolve()
        self.environ = dict(os.environ if environ is None else environ)
        # Server settings on top of the dev stack's (the benchmarks load pg_stat_statements).
        self.postgres_settings = dict(postgres_settings or {})
        self.state_file = self.data_dir / _STATE

    # -- state ---------------------------------------------------------------------------

    def state(self) -> StackState | None:
        try:
            return StackState.from_json(self.state_file.read_text())
        except FileNotFoundError:
            return None

    def _save(self, state: StackState) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        tmp = self.state_file.with_suffix(".tmp")
        tmp.write_text(state.to_json())
        tmp.replace(self.state_file)

    def running(self) -> bool:
        state = self.state()
        return state is not None and any(
            p.pid is not None and processes.is_alive(p.pid) for p in state.parts
        )

    # -- up ------------------------------------------------------------------------------

    def up(
        self,
        services: Iterable[str] = SERVICES,
        *,
        log: Callable[[str], None] = print,
        extra_env: Mapping[str, str] | None = None,
    ) -> StackState:
        """Start every part; on any failure, stop what was started and raise."""
        if self.running():
            raise ConfigError(
                f"a stack is already running under {self.data_dir}; "
                f"`calmq dev down --data-dir {self.data_dir}` stops it",
                code="stack_running",
            )
        wanted = list(services)
        unknown = [s for s in wanted if s not in SERVICES]
        if unknown:
            raise ConfigError(f"unknown service(s) {unknown}; choose from {list(SERVICES)}")
        started = time.monotonic()
        state = StackState(data_dir=str(self.data_dir))
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._save(state)
        try:
            self._start_infrastructure(state, log)
            env = dict(state.env)
            env.update(extra_env or {})
            for name in wanted:
                self._start_service(name, state, env, log)
        except BaseException:
            self.down(log=lambda _msg: None)
            raise
        state.ready_seconds = round(time.monotonic() - started, 2)
        self._save(state)
        return state

    def _start_infrastructure(self, state: StackState, log: Callable[[str], None]) -> None:
        db_url = self.environ.get("CALMQ_DATABASE_URL", "")
        bootstrap = self.environ.get("CALMQ_KAFKA_BOOTSTRAP", "")
        registry_url = self.environ.get("CALMQ_SCHEMA_REGISTRY_URL", "")
        errors: list[BaseException] = []

        pg: postgres.PostgresServer | None = None
        broker: kafka.KafkaBroker | None = None
        if not db_url:
            pg = postgres.PostgresServer(self.data_dir / "postgres", processes.free_port(),
                                         self.postgres_settings)
        if not bootstrap:
            broker = kafka.KafkaBroker(
                self.data_dir / "kafka", processes.free_port(), processes.free_port()
            )
        jars_box: list[Path] = []
        reg: registry.SchemaRegistry | None = None
        if not registry_url:
            reg = registry.SchemaRegistry(
                self.data_dir / "registry", processes.free_port(), processes.free_port()
            )

        def start_registry() -> None:
            assert reg is not None
            try:
                pid = reg.start(registry.ensure_registry_jar())
                state.parts.append(Part("schema-registry", pid, reg.url, "registry"))
                self._save(state)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                errors.append(exc)

        def start_kafka() -> None:
            assert broker is not None
            try:
                jars = kafka.ensure_jars()
                jars_box.append(jars)
                pid = broker.start(jars)
                state.parts.append(Part("kafka", pid, broker.bootstrap, "kafka"))
                self._save(state)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                errors.append(exc)

        # The JVM is the slow part: format and start it while PostgreSQL starts.
        thread = threading.Thread(target=start_kafka, name="kafka-start") if broker else None
        reg_thread = threading.Thread(target=start_registry, name="registry-start") if reg else None
        for t in (thread, reg_thread):
            if t:
                t.start()
        if pg is not None:
            pid = pg.start()
            state.parts.append(Part("postgres", pid, f"127.0.0.1:{pg.port}", "postgres"))
            self._save(state)
            processes.wait_until(
                pg.ready, timeout=30, what="PostgreSQL", alive=lambda: processes.is_alive(pid)
            )
            pg.create_database()
            db_url = pg.url
        else:
            state.parts.append(Part("postgres", None, _host_port(db_url), "postgres"))
        from calmq.data.migrations import migrate

        migrate(db_url)
        state.versions["postgres"] = postgres.server_version(db_url)

        if thread:
            thread.join()
            if errors:
                raise errors[0]
            assert broker is not None
            kafka_pid = next(p.pid for p in state.parts if p.name == "kafka")
            processes.wait_until(
                broker.ready,
                timeout=60,
                what="Kafka",
                alive=lambda: kafka_pid is not None and processes.is_alive(kafka_pid),
            )
            bootstrap = broker.bootstrap
            state.versions["kafka"] = kafka.broker_version(jars_box[0])
        else:
            state.parts.append(Part("kafka", None, bootstrap, "kafka"))
            state.versions["kafka"] = "external"

        if reg_thread:
            reg_thread.join()
            if errors:
                raise errors[0]
            assert reg is not None
            reg_pid = next(p.pid for p in state.parts if p.name == "schema-registry")
            processes.wait_until(
                reg.ready,
                timeout=60,
                what="schema registry",
                alive=lambda: reg_pid is not None and processes.is_alive(reg_pid),
            )
            registry_url = reg.url
            state.versions["schema-registry"] = f"apicurio {registry.APICURIO_VERSION}"
        elif registry_url:
            state.parts.append(Part("schema-registry", None, registry_url, "registry"))
        if registry_url:
            from calmq.codec import RegistryCodec

            RegistryCodec(registry_url).register_all()

        store_dir = self.data_dir / "objects"
        store_dir.mkdir(parents=True, exist_ok=True)
        state.env.update(
            {
                "CALMQ_DATABASE_URL": db_url,
                "CALMQ_KAFKA_BOOTSTRAP": bootstrap,
                "CALMQ_SCHEMA_REGISTRY_URL": registry_url,
                "CALMQ_OBJECT_STORE_URL": self.environ.get(
                    "CALMQ_OBJECT_STORE_URL", store_dir.as_uri()
                ),
            }
        )
        from calmq.kafka import create_topics

        create_topics(bootstrap, topics.all_topics(["default"], _tiers(self.environ)),
                      partitions=int(self.environ.get("CALMQ_TOPIC_PARTITIONS", "8")),
                      max_message_bytes=int(self.environ.get(
                          "CALMQ_KAFKA_MAX_MESSAGE_BYTES",
                          Settings.model_fields["kafka_max_message_bytes"].default)))
        self._save(state)
        log(f"postgres {state.versions['postgres']} and kafka {state.versions['kafka']} ready")

    def _start_service(
        self, name: str, state: StackState, env: dict[str, str], log: Callable[[str], None]
    ) -> None:
        port = processes.free_port()
        address = f"http://127.0.0.1:{port}"
        child_env = {k: v for k, v in self.environ.items() if not k.startswith("CALMQ_")}
        child_env.update(
            {k: v for k, v in self.environ.items() if k.startswith("CALMQ_") and k not in env}
        )
        child_env.update(env)
        child_env["PYTHONUNBUFFERED"] = "1"
        # A laptop's metrics stay on loopback; the setting's default (all interfaces) is
        # what a pod needs. A value the caller exported still wins.
        child_env.setdefault("CALMQ_METRICS_HOST", "127.0.0.1")
        argv = [sys.executable, "-m", "calmq.cli", name]
        if name == "fake-provider":
            argv += ["--port", str(port)]
        elif name == "api":
            child_env["CALMQ_API_PORT"] = str(port)
        elif name in ("relay", "worker", "forwarder", "batcher"):
            argv += ["--metrics-port", str(port)]
        pid = processes.start(argv, self.data_dir / "logs" / f"{name}.log", env=child_env)
        part = Part(name, pid, address, "http")
        state.parts.append(part)
        self._save(state)
        processes.wait_until(
            part.healthy, timeout=30, what=name, alive=lambda: processes.is_alive(pid)
        )
        if name == "fake-provider":
            state.env["CALMQ_FAKE_PROVIDER_URL"] = address
            env["CALMQ_FAKE_PROVIDER_URL"] = address
        elif name == "api":
            state.env["CALMQ_API_URL"] = address
            env["CALMQ_API_URL"] = address
        self._save(state)
        log(f"{name} ready at {address}")

    # -- down / status -------------------------------------------------------------------

    def down(self, *, log: Callable[[str], None] = print) -> list[str]:
        """Stop every part this stack started, services first, by pid; returns their names."""
        state = self.state()
        if state is None:
            return []
        stopped = []
        order = {"worker": 0, "forwarder": 0, "batcher": 0, "relay": 1, "api": 2,
                 "fake-provider": 3, "schema-registry": 4, "kafka": 5, "postgres": 6}
        for part in sorted(state.parts, key=lambda p: order.get(p.name, -1)):
            if part.pid is None:
                continue
            import signal

            # PostgreSQL: SIGINT is its "fast shutdown"; everything else stops on SIGTERM.
            sig = signal.SIGINT if part.kind == "postgres" else signal.SIGTERM
            if processes.stop(part.pid, sig=sig):
                stopped.append(part.name)
                log(f"stopped {part.name} (pid {part.pid})")
        self.state_file.unlink(missing_ok=True)
        return stopped

    def status(self) -> list[dict[str, Any]]:
        state = self.state()
        if state is None:
            return []
        return [
            {"name": p.name, "pid": p.pid, "address": p.address, "healthy": p.healthy()}
            for p in state.parts
        ]


def _host_port(url: str) -> str:
    parsed = urlparse(url)
    return f"{parsed.hostname}:{parsed.port or 5432}"


def _tiers(environ: Mapping[str, str]) -> list[str]:
    raw = environ.get("CALMQ_RETRY_TIERS", "5s,30s,2m,10m,1h")
    return [t.strip() for t in raw.split(",") if t.strip()]


def require_state(data_dir: Path) -> StackState:
    state = Stack(data_dir).state()
    if state is None:
        raise InfrastructureError(
            f"no local stack under {data_dir}; start one with `calmq dev up --data-dir {data_dir}`"
        )
    return state
