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

__all__ = ["KAFKA_VERSION", "KafkaBroker", "ensure_jars"]

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


@dataclass
class KafkaBroker:
    home: Path  # state folder of this broker (config, logs, data)
    port: int
    controller_port: int

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log_file(self) -> Path:
        return self.home / "broker.log"

    def _properties(self) -> str:
        return "\n".join(
            [
                "process.roles=broker,controller",
                "node.id=1",
                f"controller.quorum.voters=1@127.0.0.1:{self.controller_port}",
                f"listeners=PLAINTEXT://127.0.0.1:{self.port},"
                f"CONTROLLER://127.0.0.1:{self.controller_port}",
                f"advertised.listeners=PLAINTEXT://127.0.0.1:{self.port}",
                "controller.listener.names=CONTROLLER",
                "listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
                "inter.broker.listener.name=PLAINTEXT",
                f"log.dirs={self.home / 'data'}",
                "num.partitions=1",
                "auto.create.topics.enable=false",
                "offsets.topic.replication.factor=1",
                "offsets.topic.num.partitions=1",
                "transaction.state.log.replication.factor=1",
                "transaction.state.log.min.isr=1",
                "transaction.state.log.num.partitions=1",
                "share.coordinator.state.topic.replication.factor=1",
                "share.coordinator.state.topic.min.isr=1",
                "group.initial.rebalance.delay.ms=0",
                "log.cleaner.dedupe.buffer.size=2097152",
                "log.cleaner.threads=1",
                "num.network.threads=2",
                "num.io.threads=4",
                "num.recovery.threads.per.data.dir=1",
                "",
            ]
        )

    def start(self, jars: Path, java: str = "java", *, fresh: bool = True) -> int:
        """Format a fresh data dir and start the broker; returns its pid (not yet ready).

        ``fresh=False`` starts the broker on the data it already has (a restart: the chaos
        test stops the broker and brings it back with its topics and offsets)."""
        config = self.home / "server.properties"
        if not fresh:
            return processes.start(
                [java, *_JVM_FLAGS, f"-Dlog4j2.configurationFile={self.home / 'log4j2.properties'}",
                 "-cp", f"{jars}/*", "kafka.Kafka", str(config)],
                self.log_file,
            )
        shutil.rmtree(self.home / "data", ignore_errors=True)
        self.home.mkdir(parents=True, exist_ok=True)
        config.write_text(self._properties())
        log4j = resources.files(__package__).joinpath("log4j2.properties")
        classpath = f"{jars}/*"
        with resources.as_file(log4j) as log4j_path:
            log4j_copy = self.home / "log4j2.properties"
            log4j_copy.write_bytes(log4j_path.read_bytes())
        fmt = subprocess.run(
            [java, *_JVM_FLAGS, "-cp", classpath, "kafka.tools.StorageTool", "format",
             "-t", _cluster_id(), "-c", str(config)],
            capture_output=True, text=True, check=False,
        )
        if fmt.returncode != 0:
            raise InfrastructureError(f"formatting Kafka storage failed: {fmt.stdout}{fmt.stderr}")
        return processes.start(
            [java, *_JVM_FLAGS, f"-Dlog4j2.configurationFile={log4j_copy}",
             "-cp", classpath, "kafka.Kafka", str(config)],
            self.log_file,
        )

    def ready(self) -> bool:
        try:
            text = self.log_file.read_text(errors="replace")
        except FileNotFoundError:
            return False
        return "Kafka Server started" in text


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
