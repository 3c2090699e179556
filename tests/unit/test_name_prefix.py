"""Many environments on one cluster: setting name_prefix names every topic, group and subject."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from confluent_kafka.schema_registry import SchemaRegistryClient

from calmq import topics
from calmq.codec import RegistryCodec
from calmq.errors import ConfigError
from calmq.jobs import Priority
from calmq.settings import Settings


@pytest.fixture
def staging() -> Iterator[None]:
    """This process names everything as the staging. environment would, then as before."""
    topics.configure("staging.")
    yield
    topics.configure("")


def test_without_a_prefix_every_name_stays_as_it_was() -> None:
    """The default (no prefix) keeps today's topic and group names."""
    assert Settings.load(environ={}).name_prefix == ""
    assert topics.all_topics(["default"], ["5s"]) == [
        "calmq.default.interactive", "calmq.default.bulk", "calmq.default.batch",
        "calmq.retry.5s", "calmq.results", "calmq.dlq"]
    assert topics.worker_group("default") == "calmq.default"
    assert topics.FORWARDER_GROUP == "calmq.forwarder"


@pytest.mark.usefixtures("staging")
def test_a_prefix_goes_in_front_of_every_topic_and_consumer_group() -> None:
    """With name_prefix staging., every topic and group of calmq's starts with it."""
    names = topics.all_topics(["default"], ["5s", "1m"])
    assert names == [
        "staging.calmq.default.interactive", "staging.calmq.default.bulk",
        "staging.calmq.default.batch", "staging.calmq.retry.5s", "staging.calmq.retry.1m",
        "staging.calmq.results", "staging.calmq.dlq"]
    assert topics.topic_for_route(topics.work_route("default", Priority.BULK)) == names[1]
    assert topics.worker_group("default") == "staging.calmq.default"
    assert topics.batcher_group("default") == "staging.calmq.default.batcher"
    assert topics.FORWARDER_GROUP == "staging.calmq.forwarder"
    assert topics.DLQ == "staging.calmq.dlq"
    # The lag readers derive the groups from the topics' names: the prefixed ones.
    assert topics.consumer_group(names[0]) == "staging.calmq.default"
    assert topics.consumer_group("staging.calmq.retry.5s") == "staging.calmq.forwarder"
    # Another environment's topics are not this one's to read.
    assert topics.consumer_group("calmq.default.interactive") is None


@pytest.mark.usefixtures("staging")
def test_a_tenants_results_topic_carries_the_prefix_in_kafka_not_in_the_database() -> None:
    """A tenant's own results topic is prefixed in Kafka; the database keeps it without."""
    topic = topics.tenant_results_topic("acme")
    assert topic == "staging.calmq.results.acme"
    assert topics.logical_topic(topic) == "calmq.results.acme"  # what migration 0056 checks
    with pytest.raises(ConfigError):
        topics.check_results_topic("calmq.results.acme")  # production's, not staging's


@pytest.mark.parametrize("prefix", ["Staging.", "staging", ".staging.", "stag ing.",
                                    "a" * 40 + "."])
def test_a_prefix_that_cannot_begin_a_topic_name_is_refused(prefix: str) -> None:
    """name_prefix is lower case [a-z0-9._-], at most 40 long, ending in '.' or '-'."""
    with pytest.raises(ConfigError, match="name_prefix"):
        Settings.load(environ={"CALMQ_NAME_PREFIX": prefix})


def test_schema_subjects_carry_the_prefix() -> None:
    """Each environment registers its schemas under its own subjects on a shared registry."""
    registry = SchemaRegistryClient.new_client({"url": "mock://prefixed"})
    RegistryCodec("", client=registry, subject_prefix="staging.").register_all()
    RegistryCodec("", client=registry).register_all()
    subjects = registry.get_subjects()
    ours = [s for s in subjects if s.startswith("staging.")]
    assert ours
    assert sorted(s.removeprefix("staging.") for s in ours) == sorted(
        s for s in subjects if not s.startswith("staging."))
