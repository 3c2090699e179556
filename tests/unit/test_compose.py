"""docker-compose.kafka.yml: it parses, and its calmq services use settings the code reads."""

from __future__ import annotations

import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from calmq.cli import parser
from calmq.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[2]
CALMQ_SERVICES = ("init", "api", "relay", "worker", "forwarder", "fake-provider")


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    compose = yaml.safe_load((ROOT / "docker-compose.kafka.yml").read_text())
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    assert isinstance(env, dict), "write environment as a mapping, so anchors merge"
    return {k: str(v) for k, v in env.items()}


def test_compose_has_the_real_parts_and_every_calmq_service(
    services: dict[str, dict[str, Any]],
) -> None:
    """Kafka (official image, KRaft), PostgreSQL (logical WAL), Apicurio, MinIO, calmq."""
    kafka = services["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert _env(kafka)["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft, no ZooKeeper
    assert "wal_level=logical" in services["postgres"]["command"]
    assert services["schema-registry"]["image"].startswith("apicurio/apicurio-registry:")
    assert services["minio"]["image"].startswith("minio/minio")
    for name in CALMQ_SERVICES:
        assert services[name]["image"] == "calmq:latest", name


def test_every_calmq_variable_is_a_setting(services: dict[str, dict[str, Any]]) -> None:
    """Each CALMQ_ variable any service sets is a Settings field, and the values load."""
    fields = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    for name, service in services.items():
        env = _env(service)
        unknown = sorted(k for k in env if k.startswith(ENV_PREFIX) and k not in fields)
        assert unknown == [], f"{name} sets {unknown}, which calmq does not read"
        if name in CALMQ_SERVICES:
            Settings.load(environ=env)  # raises ConfigError on a bad value


def test_calmq_services_point_at_the_compose_parts(services: dict[str, dict[str, Any]]) -> None:
    """The stack locations every calmq service gets name the services of this file."""
    for name in CALMQ_SERVICES:
        settings = Settings.load(environ=_env(services[name]))
        assert settings.kafka_bootstrap == "kafka:9092", name
        assert "@postgres:5432/" in settings.database_url, name
        assert settings.schema_registry_url.startswith("http://schema-registry:8080/"), name
        assert settings.object_store_url.startswith("s3://"), name
        assert settings.fake_provider_url == "http://fake-provider:8000", name
    assert _env(services["api"])["CALMQ_API_PORT"] == services["api"]["ports"][0].split(":")[1]


def test_calmq_commands_are_real_cli_commands(services: dict[str, dict[str, Any]]) -> None:
    """Every `calmq ...` a service runs parses with calmq's own argument parser."""
    commands = []
    for name in CALMQ_SERVICES:
        command = services[name]["command"]
        # init runs `sh -c "a && b && c"`; the others an argv list.
        parts = command[-1].split("&&") if command[0] == "sh" else [shlex.join(command)]
        for part in parts:
            words = shlex.split(part)
            if words and words[0] == "calmq":
                commands.append(words[1:])
    assert {c[0] for c in commands} >= {"api", "relay", "worker", "forwarder", "topics"}
    for argv in commands:
        parser().parse_args(argv)  # SystemExit on an unknown command or flag


def test_dockerfile_installs_calmq_with_its_schemas() -> None:
    """The image builds the wheel from every package and schemas/, and installs the wheel."""
    text = (ROOT / "Dockerfile").read_text()
    for folder in ("calmq", "producers", "relay", "processors", "schemas"):
        assert f"COPY {folder} {folder}" in text
    assert "pip wheel --no-deps --wheel-dir /wheels ." in text
    assert "pip install /wheels/*.whl" in text
    assert "pip install -e" not in text
