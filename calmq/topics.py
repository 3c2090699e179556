"""Kafka topic names, derived in one place so every component agrees on where a message goes.

Work:        calmq.<pool>.<priority>      job.requested events, consumed by processors
Batch lane:  calmq.<pool>.batch           job.requested of batch-lane jobs, read by the batcher
Retry tiers: calmq.retry.<tier>           held by the forwarder until due, then sent back
Dead letter: calmq.dlq                    read by people, redriven by `calmq dlq redrive`
Results:     calmq.results                terminal events for downstream services
Per tenant:  calmq.results.<tenant>       a tenant's results, where it has a topic of its own
             calmq.results.<tenant>.dlq   and its dead letters (migration 0056)

The outbox's ``aggregatetype`` column holds the route (``default.interactive``,
``retry.5s``, ``results``); the topic is ``calmq.`` + route, which is exactly what
Debezium's outbox router produces with ``route.topic.replacement=calmq.${routedByValue}``.

Consumer groups are named here too: a pool's workers consume in ``calmq.<pool>``, its
batcher in ``calmq.<pool>.batcher``, the forwarder in ``calmq.forwarder``
(``consumer_group`` says which group reads a topic: the lag readers derive the fleet's
groups from the topics' names).

Many environments on one cluster: the setting ``name_prefix`` (``staging.``) goes in front of
every topic and group above (``staging.calmq.default.interactive``, group
``staging.calmq.default``), set once per process by :func:`configure` as its settings are
loaded (calmq.cli.flags.settings_for): a process serves one environment, and every name is
derived here, so none can be missed. The database keeps the names without it (a tenant's
``results_topic``, the outbox's routes): an environment's database is its own, and the
relay puts the prefix in front as it publishes.
"""

from __future__ import annotations

import re

from calmq.errors import ConfigError
from calmq.jobs import Priority

__all__ = [
    "BATCH",
    "DLQ",
    "DLQ_ROUTE",
    "FORWARDER_GROUP",
    "NAME_PREFIX",
    "PREFIX",
    "RESULTS",
    "RESULTS_ROUTE",
    "all_topics",
    "batch_route",
    "batcher_group",
    "check_name_prefix",
    "check_results_topic",
    "configure",
    "consumer_group",
    "dead_letter_topic",
    "logical_topic",
    "retry_route",
    "tenant_results_topic",
    "topic_for_route",
    "work_route",
    "worker_group",
]

# Every name below starts with NAME_PREFIX + "calmq." (PREFIX); configure() sets both.
BASE = "calmq."
NAME_PREFIX = ""
PREFIX = BASE
RESULTS_ROUTE = "results"
DLQ_ROUTE = "dlq"
RESULTS = PREFIX + RESULTS_ROUTE
DLQ = PREFIX + DLQ_ROUTE
# Lower case, digits, '.', '_' and '-', ending in '.' or '-' so that the prefix stays apart
# from "calmq." when read (staging.calmq.results, not stagingcalmq.results); short, as
# Kafka's topic names stop at 249 characters and a tenant's results topic is long already.
_NAME_PREFIX = re.compile(r"^(?:[a-z0-9][a-z0-9._-]{0,38}[.-])?$")
# The lane whose jobs go through the providers' batch APIs (calmq.processors.batcher); its
# topic's last part is not a priority: a batch-lane job is bulk work that can wait hours.
BATCH = "batch"


def work_route(pool: str, priority: Priority | str, lane: str = "online") -> str:
    """Where a job's job.requested goes: its pool's priority topic, or the batch lane's."""
    if lane == BATCH:
        return batch_route(pool)
    return f"{pool}.{Priority(priority).value}"


def batch_route(pool: str) -> str:
    return f"{pool}.{BATCH}"


def retry_route(tier: str) -> str:
    return f"retry.{tier}"


def topic_for_route(route: str) -> str:
    return PREFIX + route


FORWARDER_GROUP = PREFIX + "forwarder"


def check_name_prefix(prefix: str) -> str:
    """``prefix`` if it can go in front of calmq's names; ValueError otherwise."""
    if not _NAME_PREFIX.match(prefix):
        raise ValueError(
            f"{prefix!r} cannot prefix calmq's topics and groups: empty, or up to 40 lower "
            "case letters, digits, '.', '_' or '-' starting with a letter or digit and "
            "ending in '.' or '-' (staging. or prod-eu-)")
    return prefix


def configure(name_prefix: str) -> None:
    """Name every topic and group of this process with ``name_prefix`` in front (setting
    name_prefix). Module attributes, as every component reads them as ``topics.X`` when it
    names a topic, never a copy taken at import."""
    global NAME_PREFIX, PREFIX, RESULTS, DLQ, FORWARDER_GROUP
    NAME_PREFIX = check_name_prefix(name_prefix)
    PREFIX = NAME_PREFIX + BASE
    RESULTS = PREFIX + RESULTS_ROUTE
    DLQ = PREFIX + DLQ_ROUTE
    FORWARDER_GROUP = PREFIX + "forwarder"


def logical_topic(topic: str) -> str:
    """``topic`` without this environment's name prefix: as the database keeps it."""
    return topic[len(NAME_PREFIX):] if topic.startswith(NAME_PREFIX) else topic


def worker_group(pool: str) -> str:
    """The consumer group of a pool's workers (KEDA scales on its lag)."""
    return PREFIX + pool


def batcher_group(pool: str) -> str:
    return f"{PREFIX}{pool}.{BATCH}er"


def consumer_group(topic: str) -> str | None:
    """The calmq consumer group that reads ``topic``; None for a topic no group of calmq's
    consumes (results, dead letters: read by people and downstream services)."""
    if not topic.startswith(PREFIX):
        return None
    pool, _, last = topic[len(PREFIX):].rpartition(".")
    if pool == "retry":
        return FORWARDER_GROUP
    if not pool or "." in pool:
        return None
    if last == BATCH:
        return batcher_group(pool)
    if last in {p.value for p in Priority}:
        return worker_group(pool)
    return None


def all_topics(pools: list[str], tiers: list[str]) -> list[str]:
    """Every topic a deployment with these pools and retry tiers needs."""
    topics = [topic_for_route(work_route(p, prio)) for p in pools for prio in Priority]
    topics += [topic_for_route(batch_route(p)) for p in pools]
    topics += [topic_for_route(retry_route(t)) for t in tiers]
    return [*topics, RESULTS, DLQ]


# A tenant's own results topic: under calmq.results., in Kafka's alphabet, short enough for
# its ".dlq" twin (249 characters at most). The database checks the same (migration 0056),
# of the name without the environment's prefix (logical_topic).
_TENANT_TOPIC = re.compile(r"^calmq\.results\.[A-Za-z0-9._-]{1,200}$")


def check_results_topic(topic: str) -> str:
    """``topic`` if a tenant's results may go there; ConfigError otherwise.

    Under ``calmq.results.`` so that it can never be a work, retry or dead-letter topic, and
    not named like a pool's work topic (``calmq.results.bulk``), which the lag readers would
    take for the workers' of a pool named ``results``."""
    if (not topic.startswith(NAME_PREFIX) or not _TENANT_TOPIC.match(logical_topic(topic))
            or consumer_group(topic) is not None):
        raise ConfigError(
            f"{topic!r} cannot be a tenant's results topic: it is {RESULTS}. followed by "
            "1 to 200 letters, digits, '.', '_' or '-', and not by a priority or 'batch'",
            code="invalid_results_topic")
    return topic


def tenant_results_topic(tenant: str) -> str:
    """``calmq.results.<tenant>``: the tenant's own results topic (setting
    results_topic_per_tenant); ConfigError when the name cannot be part of a topic's."""
    return check_results_topic(f"{RESULTS}.{tenant}")


def dead_letter_topic(results_topic: str) -> str:
    """Where the dead letters of a tenant whose results go to ``results_topic`` go."""
    return results_topic + ".dlq"
