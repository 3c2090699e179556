"""The local stack behind `calmq dev up|down|status|env`, also used by the test fixtures.

Everything it starts is a child process whose pid is written to ``<data dir>/stack.json``
as soon as it exists, so ``down`` stops exactly what ``up`` started even after a failed
``up``. External services named by ``CALMQ_DATABASE_URL``, ``CALMQ_KAFKA_BOOTSTRAP`` or
``CALMQ_SCHEMA_REGISTRY_URL`` are used instead of starting our own.

Production-shaped variants (``calmq dev up --secure``, ``--brokers 3``): the broker with only
a SASL_SSL listener (SCRAM-SHA-512, a CA and certificates made at start) and the registry
behind HTTPS with basic auth; or a three-broker KRaft cluster whose topics have replication
factor 3 and ``min.insync.replicas=2``.
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
from calmq.tooling.devstack import kafka, pgbouncer, postgres, processes, registry, tls

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
        if self.kind == "registry-tls" or self.address.startswith("https://"):
            # The secured stack's registry needs its CA and credentials: is it listening?
            parsed = urlparse(self.address)
            return processes.port_open(parsed.hostname or "127.0.0.1", parsed.port or 443)
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
    options: dict[str, Any] = field(default_factory=dict)  # secure, brokers

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
                 postgres_settings: Mapping[str, str] | None = None,
                 secure: bool = False, brokers: int = 1, standby: bool = False,
                 pooler: bool = False) -> None:
        self.data_dir = data_dir.resolve()
        self.environ = dict(os.environ if environ is None else environ)
        # Server settings on top of the dev stack's (the benchmarks load pg_stat_statements).
        self.postgres_settings = dict(postgres_settings or {})
        self.state_file = self.data_dir / _STATE
        if brokers not in (1, 3):
            raise ConfigError(f"--brokers {brokers}: the local stack runs 1 or 3 brokers",
                              code="invalid_setting")
        if secure and brokers != 1:
            raise ConfigError("--secure runs one broker; --brokers 3 runs plaintext",
                              code="invalid_setting")
        self.secure = secure
        self.brokers = brokers
        self.standby = standby
        self.pooler = pooler
        self._saving = threading.Lock()

    # -- state ---------------------------------------------------------------------------

    def state(self) -> StackState | None:
        try:
            return StackState.from_json(self.state_file.read_text())
        except FileNotFoundError:
            return None

    def _save(self, state: StackState) -> None:
        # Kafka and the registry start in threads, each saving as its part comes up: one at
        # a time, or one thread's rename finds the other's temporary file gone (a bench run
        # failed on it) and stack.json holds two documents.
        with self._saving:
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
        state = StackState(data_dir=str(self.data_dir),
                           options={"secure": self.secure, "brokers": self.brokers,
                                    "standby": self.standby, "pgbouncer": self.pooler})
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
        security_env: dict[str, str] = {}

        pg: postgres.PostgresServer | None = None
        brokers: list[kafka.KafkaBroker] = []
        broker_security: kafka.BrokerSecurity | None = None
        registry_tls: tuple[tls.ServerCertificate, Path, Path] | None = None
        if self.secure:
            broker_security, registry_tls, security_env = self._make_secrets()
        if not db_url:
            pg = postgres.PostgresServer(self.data_dir / "postgres", processes.free_port(),
                                         self.postgres_settings)
        if not bootstrap:
            ports = [(processes.free_port(), processes.free_port())
                     for _ in range(self.brokers)]
            voters = ",".join(f"{i}@127.0.0.1:{c}" for i, (_p, c) in enumerate(ports, 1))
            home = self.data_dir / "kafka"
            brokers = [kafka.KafkaBroker(home if self.brokers == 1 else home / f"node-{i}",
                                         port, controller, node_id=i, voters=voters,
                                         replication=self.brokers, security=broker_security)
                       for i, (port, controller) in enumerate(ports, 1)]
        jars_box: list[Path] = []
        reg: registry.SchemaRegistry | None = None
        if not registry_url:
            reg = registry.SchemaRegistry(
                self.data_dir / "registry", processes.free_port(), processes.free_port(),
                tls=None if registry_tls is None else (
                    registry_tls[0].certificate, registry_tls[0].key, registry_tls[2]))

        def start_registry() -> None:
            assert reg is not None
            try:
                pid = reg.start(registry.ensure_registry_jar())
                state.parts.append(Part("schema-registry", pid, reg.url, "registry"))
                self._save(state)
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                errors.append(exc)

        def start_kafka() -> None:
            try:
                jars = kafka.ensure_jars()
                jars_box.append(jars)
                cluster = kafka.cluster_id()
                # Each node formats its storage (a JVM run) and starts: all at once.
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(max_workers=len(brokers)) as pool:
                    futures = [pool.submit(b.start, jars, cluster_id=cluster) for b in brokers]
                failed: BaseException | None = None
                for broker, future in zip(brokers, futures, strict=True):
                    try:
                        pid = future.result()
                    except BaseException as exc:  # noqa: BLE001 - the others are recorded
                        failed = failed or exc
                        continue
                    name = "kafka" if len(brokers) == 1 else f"kafka-{broker.node_id}"
                    state.parts.append(Part(name, pid, broker.bootstrap, "kafka"))
                self._save(state)  # every started node is in stack.json, so `down` stops it
                if failed is not None:
                    raise failed
            except BaseException as exc:  # noqa: BLE001 - handed to the main thread
                errors.append(exc)

        # The JVM is the slow part: format and start it while PostgreSQL starts.
        thread = threading.Thread(target=start_kafka, name="kafka-start") if brokers else None
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
            if self.standby:
                self._start_standby(state, pg)
        else:
            state.parts.append(Part("postgres", None, _host_port(db_url), "postgres"))
        from calmq.data.migrations import migrate

        migrate(db_url)
        state.versions["postgres"] = postgres.server_version(db_url)
        pooled_env: dict[str, str] = {}
        if self.pooler:
            pooled_env = self._start_pgbouncer(state, db_url, pg)

        if thread:
            thread.join()
            if errors:
                raise errors[0]
            for broker in brokers:
                name = "kafka" if len(brokers) == 1 else f"kafka-{broker.node_id}"
                kafka_pid = next(p.pid for p in state.parts if p.name == name)
                processes.wait_until(
                    broker.ready,
                    timeout=90,
                    what="Kafka" if len(brokers) == 1 else f"Kafka node {broker.node_id}",
                    alive=_alive(kafka_pid),
                )
            bootstrap = ",".join(b.bootstrap for b in brokers)
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
            if registry_tls is not None:
                registry_url = self._start_registry_proxy(state, reg.url, registry_tls)
        elif registry_url:
            state.parts.append(Part("schema-registry", None, registry_url, "registry"))

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
                **security_env,
                **pooled_env,
            }
        )
        if self.brokers > 1:
            state.env["CALMQ_TOPIC_REPLICATION"] = str(self.brokers)
            state.env["CALMQ_TOPIC_MIN_INSYNC_REPLICAS"] = "2"
        from calmq.codec import RegistryCodec, registry_config
        from calmq.kafka import connection_config, create_topics

        # The stack's own clients use the settings its services get: the secured stack's
        # credentials, CA and the *_FILE secrets included; for a broker or registry it did
        # not start, the caller's settings of it (its *_FILE secrets too).
        settings = Settings.load(environ=self._client_env(
            state.env, external_kafka=not brokers, external_registry=reg is None))
        # The caller's name prefix, which the services inherit: their topics and subjects.
        prefix = topics.check_name_prefix(self.environ.get("CALMQ_NAME_PREFIX", ""))
        if registry_url:
            RegistryCodec(registry_url, config=registry_config(settings),
                          subject_prefix=prefix).register_all()
        topics.configure(prefix)
        create_topics(connection_config(settings),
                      topics.all_topics(["default"], _tiers(self.environ)),
                      partitions=int(self.environ.get("CALMQ_TOPIC_PARTITIONS", "8")),
                      replication=self.brokers,
                      min_insync_replicas=2 if self.brokers > 1 else None,
                      max_message_bytes=int(self.environ.get(
                          "CALMQ_KAFKA_MAX_MESSAGE_BYTES",
                          Settings.model_fields["kafka_max_message_bytes"].default)))
        self._save(state)
        log(f"postgres {state.versions['postgres']} and kafka {state.versions['kafka']} ready")

    def _start_pgbouncer(self, state: StackState, db_url: str,
                         pg: postgres.PostgresServer | None) -> dict[str, str]:
        """PgBouncer in transaction mode in front of PostgreSQL; the settings that route the
        services through it, and the relay and LISTEN around it."""
        server = urlparse(db_url)
        bouncer = pgbouncer.PgBouncer(self.data_dir / "pgbouncer", processes.free_port(),
                                      server.port or 5432)
        user = pg.run_as() if pg is not None else None
        pid = bouncer.start(user)
        state.parts.append(Part("pgbouncer", pid, f"127.0.0.1:{bouncer.port}", "postgres"))
        self._save(state)
        processes.wait_until(bouncer.ready, timeout=30, what="PgBouncer",
                             alive=lambda: processes.is_alive(pid))
        state.versions["pgbouncer"] = pgbouncer.version()
        return {"CALMQ_DATABASE_URL": bouncer.url, "CALMQ_DATABASE_POOLER": "transaction",
                "CALMQ_DIRECT_DATABASE_URL": db_url, "CALMQ_RELAY_DATABASE_URL": db_url}

    def _start_standby(self, state: StackState, primary: postgres.PostgresServer) -> None:
        """A streaming standby of the primary that synchronises the relay's failover slot."""
        import psycopg

        standby = postgres.PostgresServer(self.data_dir / "postgres-standby",
                                          processes.free_port(), self.postgres_settings)
        pid = standby.start_standby(primary)
        state.parts.append(Part("postgres-standby", pid, f"127.0.0.1:{standby.port}",
                                "postgres"))
        self._save(state)
        processes.wait_until(standby.ready, timeout=60, what="the PostgreSQL standby",
                             alive=lambda: processes.is_alive(pid))
        # Only now that the standby's slot exists: logical changes leave the primary only
        # once the standby has them, so a promoted standby never lacks an event the relay
        # already published (set before the slot exists, it would hold the relay back).
        # Synchronous replication to it, too (RDS Multi-AZ, Patroni's synchronous mode): a
        # commit the API answered 202 for is on the standby when it is promoted.
        with psycopg.connect(primary.url, autocommit=True) as conn:
            conn.execute(f"ALTER SYSTEM SET synchronized_standby_slots = "
                         f"'{postgres.STANDBY_SLOT}'")
            conn.execute("ALTER SYSTEM SET synchronous_standby_names = 'calmq_standby'")
            conn.execute("SELECT pg_reload_conf()")

    def _make_secrets(self) -> tuple[kafka.BrokerSecurity,
                                     tuple[tls.ServerCertificate, Path, Path],
                                     dict[str, str]]:
        """The secured stack's CA, certificates and passwords, and the settings that use
        them. Passwords are files (``CALMQ_*_PASSWORD_FILE``), as a Kubernetes Secret
        mounted in a pod would give them."""
        import secrets

        authority = tls.make_authority(self.data_dir / "tls")
        broker_cert = authority.issue("kafka")
        registry_cert = authority.issue("registry")
        secret_dir = self.data_dir / "secrets"
        secret_dir.mkdir(parents=True, exist_ok=True)
        secret_dir.chmod(0o700)
        kafka_password = secrets.token_urlsafe(18)
        registry_password = secrets.token_urlsafe(18)
        for name, value in (("kafka-password", kafka_password),
                            ("registry-password", registry_password),
                            ("registry-users", f"calmq:{registry_password}\n")):
            path = secret_dir / name
            path.write_text(value)
            path.chmod(0o600)
        security = kafka.BrokerSecurity(
            broker_cert.keystore, authority.ca,
            {"broker": secrets.token_urlsafe(18), "calmq": kafka_password})
        env = {
            "CALMQ_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
            "CALMQ_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
            "CALMQ_KAFKA_SASL_USERNAME": "calmq",
            "CALMQ_KAFKA_SASL_PASSWORD_FILE": str(secret_dir / "kafka-password"),
            "CALMQ_KAFKA_SSL_CA_LOCATION": str(authority.ca),
            "CALMQ_SCHEMA_REGISTRY_USERNAME": "calmq",
            "CALMQ_SCHEMA_REGISTRY_PASSWORD_FILE": str(secret_dir / "registry-password"),
            "CALMQ_SCHEMA_REGISTRY_CA_LOCATION": str(authority.ca),
        }
        return security, (registry_cert, secret_dir / "registry-users", authority.ca), env

    def _start_registry_proxy(self, state: StackState, upstream: str,
                              registry_tls: tuple[tls.ServerCertificate, Path, Path]) -> str:
        """HTTPS with basic auth in front of Apicurio (registry_proxy.py says why); Apicurio
        itself serves HTTPS only, so no plain HTTP port is open either."""
        cert, users, ca = registry_tls
        port = processes.free_port()
        upstream_root = upstream.split("/apis/", 1)[0]
        pid = processes.start(
            [sys.executable, "-m", "calmq.tooling.devstack.registry_proxy", "--port", str(port),
             "--upstream", upstream_root, "--upstream-ca", str(ca), "--users", str(users),
             "--cert", str(cert.certificate),
             "--key", str(cert.key)],
            self.data_dir / "registry" / "proxy.log")
        url = f"https://127.0.0.1:{port}/apis/ccompat/v7"
        part = Part("schema-registry-proxy", pid, url, "registry-tls")
        state.parts.append(part)
        self._save(state)
        processes.wait_until(part.healthy, timeout=30, what="registry proxy",
                             alive=lambda: processes.is_alive(pid))
        return url

    def _client_env(self, env: Mapping[str, str], *, external_kafka: bool,
                    external_registry: bool) -> dict[str, str]:
        """The settings of the stack's own clients: ``env``, and the caller's ``CALMQ_KAFKA_*``
        / ``CALMQ_SCHEMA_REGISTRY_*`` variables for a part it did not start (a variable
        whose ``_FILE`` twin, or plain twin, the stack set is left out: one source each)."""
        out = {k: v for k, v in env.items() if k.startswith("CALMQ_")}
        prefixes = tuple(p for p, external in (("CALMQ_KAFKA_", external_kafka),
                                               ("CALMQ_SCHEMA_REGISTRY_", external_registry))
                         if external)
        if not prefixes:
            return out
        for key, value in self.environ.items():
            twin = key.removesuffix("_FILE") if key.endswith("_FILE") else f"{key}_FILE"
            if key.startswith(prefixes) and key not in out and twin not in out:
                out[key] = value
        return out

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
        log_file = self.data_dir / "logs" / f"{name}.log"
        pid = processes.start(argv, log_file, env=child_env)
        part = Part(name, pid, address, "http")
        state.parts.append(part)
        self._save(state)
        try:
            processes.wait_until(
                part.healthy, timeout=30, what=name, alive=lambda: processes.is_alive(pid)
            )
        except InfrastructureError as exc:
            # The service's own last words name the fix (a missing extra, a bad setting);
            # "exited before it was ready" alone sends a person to the log file.
            raise InfrastructureError(f"{exc}: {_last_words(log_file)} (log: {log_file})",
                                      code=exc.code) from exc
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
                 "pgbouncer": 5,
                 "fake-provider": 3, "schema-registry-proxy": 4, "schema-registry": 4,
                 "kafka": 5, "postgres-standby": 6, "postgres": 7}
        for part in sorted(state.parts,
                           key=lambda p: 5 if p.kind == "kafka" else order.get(p.name, -1)):
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


def _alive(pid: int | None) -> Callable[[], bool]:
    return lambda: pid is not None and processes.is_alive(pid)


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


def _last_words(log_file: Path, lines: int = 3) -> str:
    """The last non-empty lines a service wrote before it stopped, on one line."""
    try:
        text = log_file.read_text(errors="replace")
    except OSError:
        return "it wrote no log"
    tail = [line.strip() for line in text.splitlines() if line.strip()][-lines:]
    return " | ".join(tail) or "it wrote nothing"
