"""A Confluent-compatible schema registry: Apicurio Registry (ccompat API), from Maven Central.

Each Apicurio release publishes a ready-built distribution
(``io.apicurio:apicurio-registry-app:<v>:tar.gz:all``); registry-pom.xml unpacks it once per
user into ``~/.cache/calmq/apicurio-<v>``. 2.6.x runs on Java 17 (3.x needs Java 21).
Storage is in memory: the stack registers calmq's schemas at every ``up``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from calmq.errors import InfrastructureError
from calmq.tooling.devstack import processes
from calmq.tooling.devstack.kafka import cache_root

__all__ = ["APICURIO_VERSION", "SchemaRegistry", "ensure_registry_jar"]

APICURIO_VERSION = "2.6.13.Final"


def ensure_registry_jar() -> Path:
    target = cache_root() / f"apicurio-{APICURIO_VERSION}"
    jar = target / f"apicurio-registry-app-{APICURIO_VERSION}-runner.jar"
    if jar.exists():
        return jar
    if shutil.which("mvn") is None:
        raise InfrastructureError("Maven (mvn) is needed once to fetch Apicurio Registry")
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    # Maven runs in the cache folder, which a fresh machine does not have yet (the Kafka
    # jars are fetched at the same moment on another thread and may not have made it).
    cache_root().mkdir(parents=True, exist_ok=True)
    pom = resources.files(__package__).joinpath("registry-pom.xml")
    with resources.as_file(pom) as pom_path:
        result = subprocess.run(
            ["mvn", "-q", "-B", "-f", str(pom_path), f"-Dapicurio.version={APICURIO_VERSION}",
             f"-Dapicurio.dir={tmp}",
             "dependency:unpack"],
            capture_output=True, text=True, check=False, cwd=cache_root(),
        )
    shutil.rmtree(f"{tmp}.markers", ignore_errors=True)
    if result.returncode != 0 or not (tmp / jar.name).exists():
        raise InfrastructureError(
            f"fetching Apicurio Registry {APICURIO_VERSION} failed:\n"
            f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
        )
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return jar


@dataclass
class SchemaRegistry:
    home: Path
    port: int
    management_port: int
    # The secured stack: HTTPS only (Quarkus opens no plain HTTP port), certificate and key
    # PEM files, and the CA that signed them for the readiness probe.
    tls: tuple[Path, Path, Path] | None = None

    @property
    def url(self) -> str:
        scheme = "https" if self.tls else "http"
        return f"{scheme}://127.0.0.1:{self.port}/apis/ccompat/v7"

    def start(self, jar: Path, java: str = "java") -> int:
        self.home.mkdir(parents=True, exist_ok=True)
        http = ["-Dquarkus.http.host=127.0.0.1", f"-Dquarkus.http.port={self.port}"]
        if self.tls is not None:
            cert, key, _ca = self.tls
            http = ["-Dquarkus.http.host=127.0.0.1", "-Dquarkus.http.port=0",
                    f"-Dquarkus.http.ssl-port={self.port}",
                    f"-Dquarkus.http.ssl.certificate.files={cert}",
                    f"-Dquarkus.http.ssl.certificate.key-files={key}",
                    "-Dquarkus.http.insecure-requests=disabled"]
        return processes.start(
            [java, "-Xmx256m", "-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC", *http,
             "-Dquarkus.management.host=127.0.0.1",
             f"-Dquarkus.management.port={self.management_port}",
             "-jar", str(jar)],
            self.home / "registry.log",
            cwd=self.home,
        )

    def ready(self) -> bool:
        import ssl
        import urllib.request

        context = ssl.create_default_context(cafile=str(self.tls[2])) if self.tls else None
        try:
            with urllib.request.urlopen(self.url + "/subjects", timeout=1,  # noqa: S310
                                        context=context) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False
