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
    "PREFIX",
    "RESULTS",
    "RESULTS_ROUTE",
    "all_topics",
    "batch_route",
    "batcher_group",
    "check_results_topic",
    "consumer_group",
    "dead_letter_topic",
    "retry_route",
    "tenant_results_topic",
    "topic_for_route",
    "work_route",
    "worker_group",
]

PREFIX = "calmq."
RESULTS_ROUTE = "results"
DLQ_ROUTE = "dlq"
RESULTS = PREFIX + RESULTS_ROUTE
DLQ = PREFIX + DLQ_ROUTE
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
# its ".dlq" twin (249 characters at most). The database checks the same (migration 0056).
_TENANT_TOPIC = re.compile(r"^calmq\.results\.[A-Za-z0-9._-]{1,200}$")


def check_results_topic(topic: str) -> str:
    """``topic`` if a tenant's results may go there; ConfigError otherwise.

    Under ``calmq.results.`` so that it can never be a work, retry or dead-letter topic, and
    not named like a pool's work topic (``calmq.results.bulk``), which the lag readers would
    take for the workers' of a pool named ``results``."""
    if not _TENANT_TOPIC.match(topic) or consumer_group(topic) is not None:
        raise ConfigError(
            f"{topic!r} cannot be a tenant's results topic: it is calmq.results. followed by "
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
