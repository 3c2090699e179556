"""The consumer examples' defaults reach the Docker Compose stack from its host: the API,
the registry and the broker at the ports docker-compose.kafka.yml publishes."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "consumers"
SOURCES = {
    "python": EXAMPLES / "python" / "consume_results.py",
    "java": EXAMPLES / "java" / "src" / "main" / "java" / "dev" / "calmq" / "examples"
    / "ResultsConsumer.java",
    "go": EXAMPLES / "go" / "main.go",
    "node": EXAMPLES / "node" / "consume_results.mjs",
}


def _published(service: str, inside: int) -> int:
    """The host port docker-compose.kafka.yml publishes for ``service``'s port ``inside``."""
    compose = yaml.safe_load((ROOT / "docker-compose.kafka.yml").read_text())
    for mapping in compose["services"][service]["ports"]:
        host, _, container = str(mapping).partition(":")
        if int(container) == inside:
            return int(host)
    raise AssertionError(f"{service} publishes no port for {inside}")


def _external_listener() -> str:
    compose = yaml.safe_load((ROOT / "docker-compose.kafka.yml").read_text())
    advertised = compose["services"]["kafka"]["environment"]["KAFKA_ADVERTISED_LISTENERS"]
    return re.search(r"EXTERNAL://([^,]+)", advertised).group(1)  # type: ignore[union-attr]


@pytest.mark.parametrize("language", list(SOURCES))
def test_defaults_are_the_compose_stacks_ports(language: str) -> None:
    """Each example defaults to the API on 8080, the registry's ccompat API on 8081 and the
    broker's external listener, never to the fake provider's port."""
    text = SOURCES[language].read_text()
    api = f"http://localhost:{_published('api', 8080)}"
    registry = f"http://localhost:{_published('schema-registry', 8080)}/apis/ccompat/v7"
    fake_provider = f"localhost:{_published('fake-provider', 8000)}"
    assert f'"{api}"' in text
    assert f'"{registry}"' in text
    assert f'"{_external_listener()}"' in text
    assert fake_provider not in text


@pytest.mark.parametrize("language", list(SOURCES))
def test_each_example_takes_a_properties_file_and_a_topic(language: str) -> None:
    """Each example reads a properties file (a secured cluster) and the topic to read (a
    tenant's own), from a flag or its environment variable."""
    text = SOURCES[language].read_text()
    assert "CALMQ_CONSUMER_CONFIG" in text
    assert "CALMQ_RESULTS_TOPIC" in text
    assert "schema.registry.basic.auth.user.info" in text
