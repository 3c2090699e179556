"""A real Apache Kafka broker (KRaft, combined mode, one node) from the jars on Maven Central.

The jars are resolved once per user with Maven into ``~/.cache/calmq/kafka-<version>``;
every ``up`` formats a fresh log directory, so each run starts from an empty cluster.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import uuid
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from calmq.errors import InfrastructureError
from calmq.tooling.devstack import processes

__all__ = ["KAFKA_VERSION", "BrokerSecurity", "KafkaBroker", "cluster_id", "ensure_jars"]

KAFKA_VERSION = "4.1.1"
_JVM_FLAGS = [
    "-Xms512m",
    "-Xmx512m",
    # C1 only: the broker of a dev stack starts in ~1.5 s instead of ~4 s and runs fast enough.
    "-XX:TieredStopAtLevel=1",
    "-XX:+UseSerialGC",
    "-Djava.awt.headless=true",
]


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "calmq"


def ensure_jars() -> Path:
    """The broker's runtime classpath folder, fetched with Maven the first time."""
    target = cache_root() / f"kafka-{KAFKA_VERSION}"
    marker = target / ".complete"
    if marker.exists():
        return target
    if shutil.which("mvn") is None:
        raise InfrastructureError("Maven (mvn) is needed once to fetch the Kafka jars")
    pom = resources.files(__package__).joinpath("kafka-pom.xml")
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    with resources.as_file(pom) as pom_path:
        result = subprocess.run(
            [
                "mvn", "-q", "-B", "-f", str(pom_path),
                f"-Dkafka.version={KAFKA_VERSION}",
                "dependency:copy-dependencies",
                f"-DoutputDirectory={tmp}",
                "-DincludeScope=runtime",
            ],
            capture_output=True, text=True, check=False,
        )
    if result.returncode != 0:
        raise InfrastructureError(
            f"fetching the Kafka {KAFKA_VERSION} jars with Maven failed:\n"
            f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )
    (tmp / ".complete").write_text(KAFKA_VERSION)
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


@dataclass(frozen=True)
class BrokerSecurity:
    """A broker that speaks only SASL_SSL (SCRAM-SHA-512) to clients and to other brokers,
    and TLS on its controller listener: no plaintext listener at all."""

    keystore: Path  # PEM: the broker's private key and certificate chain
    truststore: Path  # PEM: the CA, for the connections it makes itself
    users: dict[str, str]  # SCRAM-SHA-512 user -> password; the first is inter-broker

    @property
    def broker_user(self) -> tuple[str, str]:
        return next(iter(self.users.items()))


@dataclass
class KafkaBroker:
    """One KRaft node in combined mode (broker and controller). ``voters`` lists every node
    of the cluster (``id@host:controller_port,...``); alone, it is its own quorum."""

    home: Path  # state folder of this broker (config, logs, data)
    port: int
    controller_port: int
    node_id: int = 1
    voters: str = ""
    replication: int = 1  # brokers in the cluster: the internal topics' replication
    security: BrokerSecurity | None = None

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.home / "broker.log"

    @property
    def data_dir(self) -> Path:
        return self.home / "data"

    def quorum_leader(self) -> int | None:
        """The KRaft quorum leader (the active controller) as this node last knew it, from
        the quorum-state file it keeps beside its metadata log."""
        import json

        try:
            state = json.loads((self.data_dir / "__cluster_metadata-0" / "quorum-state")
                               .read_text())
        except (OSError, ValueError):
            return None
        leader = state.get("leaderId", -1)
        return int(leader) if isinstance(leader, int) and leader >= 0 else None

    def _listeners(self) -> list[str]:
        c = f"CONTROLLER://127.0.0.1:{self.controller_port}"
        if self.security is None:
            return [
                f"listeners=PLAINTEXT://127.0.0.1:{self.port},{c}",
                f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}",
                "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                "inter.broker.listener.name=PLAINTEXT",
            ]
        user, password = self.security.broker_user
        return [
            f"listeners=SASL_SSL://127.0.0.1:{self.port},{c}",
            f"advertised.listeners=SASL_SSL://127.0.0.1:{self.port}",
            # The controller listener is TLS as well (KRaft controllers cannot check SCRAM
            # credentials: those live in the metadata the controllers serve).
            "listener.security.protocol.map=SASL_SSL:SASL_SSL,CONTROLLER:SSL",
            "inter.broker.listener.name=SASL_SSL",
            "sasl.enabled.mechanisms=SCRAM-SHA-512",
            "sasl.mechanism.inter.broker.protocol=SCRAM-SHA-512",
            "listener.name.sasl_ssl.scram-sha-512.sasl.jaas.config="
            "org.apache.kafka.common.security.scram.ScramLoginModule required "
            f'username="{user}" password="{password}";',
            "ssl.keystore.type=PEM",
            f"ssl.keystore.location={self.security.keystore}",
            "ssl.truststore.type=PEM",
            f"ssl.truststore.location={self.security.truststore}",
            "ssl.client.auth=none",
        ]

    def _properties(self) -> str:
        nodes = self.replication
        min_isr = 2 if nodes >= 3 else 1
        voters = self.voters or f"{self.node_id}@127.0.0.1:{self.controller_port}"
        return "\n".join(
            [
                "process.roles=broker,controller",
                f"node.id={self.node_id}",
                f"controller.quorum.voters={voters}",
                *self._listeners(),
                "controller.listener.names=CONTROLLER",
                f"log.dirs={self.data_dir}",
                "num.partitions=1",
                "auto.create.topics.enable=false",
                f"default.replication.factor={nodes}",
                f"min.insync.replicas={min_isr}",
                f"offsets.topic.replication.factor={nodes}",
                "offsets.topic.num.partitions=1",
                f"transaction.state.log.replication.factor={nodes}",
                f"transaction.state.log.min.isr={min_isr}",
                "transaction.state.log.num.partitions=1",
                f"share.coordinator.state.topic.replication.factor={nodes}",
                f"share.coordinator.state.topic.min.isr={min_isr}",
                "group.initial.rebalance.delay.ms=0",
                "log.cleaner.dedupe.buffer.size=2097152",
                "log.cleaner.threads=1",
                "num.network.threads=2",
                "num.io.threads=4",
                "num.recovery.threads.per.data.dir=1",
                # A killed node's replicas rejoin the ISR within seconds of its restart.
                "replica.lag.time.max.ms=10000",
                "",
            ]
        )

    def _java(self, java: str, jars: Path, config: Path) -> list[str]:
        flags = list(_JVM_FLAGS)
        if self.replication > 1:  # three JVMs on a laptop: a smaller heap each
            flags = [f for f in flags if not f.startswith(("-Xms", "-Xmx"))]
            flags += ["-Xms256m", "-Xmx384m"]
        return [java, *flags, f"-Dlog4j2.configurationFile={self.home / 'log4j2.properties'}",
                "-cp", f"{jars}/*", "kafka.Kafka", str(config)]

    def start(self, jars: Path, java: str = "java", *, fresh: bool = True,
              cluster_id: str | None = None) -> int:
        """Format a fresh data dir and start the broker; returns its pid (not yet ready).

        ``fresh=False`` starts the broker on the data it already has (a restart: the chaos
        test stops the broker and brings it back with its topics and offsets). Nodes of one
        cluster are formatted with the same ``cluster_id``."""
        config = self.home / "server.properties"
        if not fresh:
            return processes.start(self._java(java, jars, config), self.log_file)
        shutil.rmtree(self.data_dir, ignore_errors=True)
        self.home.mkdir(parents=True, exist_ok=True)
        config.write_text(self._properties())
        log4j = resources.files(__package__).joinpath("log4j2.properties")
        with resources.as_file(log4j) as log4j_path:
            (self.home / "log4j2.properties").write_bytes(log4j_path.read_bytes())
        scram: list[str] = []
        for user, password in (self.security.users.items() if self.security else ()):
            scram += ["--add-scram", f"SCRAM-SHA-512=[name={user},password={password}]"]
        fmt = subprocess.run(
            [java, *_JVM_FLAGS, "-cp", f"{jars}/*", "kafka.tools.StorageTool", "format",
             "-t", cluster_id or _cluster_id(), "-c", str(config), *scram],
            capture_output=True, text=True, check=False,
        )
        if fmt.returncode != 0:
            raise InfrastructureError(f"formatting Kafka storage failed: {fmt.stdout}{fmt.stderr}")
        return processes.start(self._java(java, jars, config), self.log_file)

    def ready(self) -> bool:
        try:
            text = self.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return False
        return "Kafka Server started" in text


def cluster_id() -> str:
    """A new cluster id for the storage tool."""
    return _cluster_id()


def _cluster_id() -> str:
    # A Kafka cluster id is a base64url UUID without padding, 22 characters. One in 64
    # starts with "-", which the storage tool's argument parser takes for an option and
    # refuses (Kafka's own Uuid.randomUuid() draws again for the same reason).
    import base64

    while True:
        cluster_id = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cluster_id.startswith("-"):
            return cluster_id


def broker_version(jars: Path) -> str:
    for jar in jars.glob("kafka_2.13-*.jar"):
        match = re.search(r"kafka_2\.13-(.+)\.jar$", jar.name)
        if match:
            return match[1]
    return KAFKA_VERSION
