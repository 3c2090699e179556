"""Kafka topic names, derived in one place so every component agrees on where a message goes.

Work:        calmq.<pool>.<priority>      job.requested events, consumed by processors
Batch lane:  calmq.<pool>.batch           job.requested of batch-lane jobs, read by the batcher
Retry tiers: calmq.retry.<tier>           held by the forwarder until due, then sent back
Dead letter: calmq.dlq                    read by people, redriven by `calmq dlq redrive`
Results:     calmq.results                terminal events for downstream services

The outbox's ``aggregatetype`` column holds the route (``default.interactive``,
``retry.5s``, ``results``); the topic is ``calmq.`` + route, which is exactly what
Debezium's outbox router produces with ``route.topic.replacement=calmq.${routedByValue}``.
"""

from __future__ import annotations

from calmq.jobs import Priority

__all__ = [
    "BATCH",
    "DLQ",
    "DLQ_ROUTE",
    "PREFIX",
    "RESULTS",
    "RESULTS_ROUTE",
    "all_topics",
    "batch_route",
    "retry_route",
    "topic_for_route",
    "work_route",
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


def all_topics(pools: list[str], tiers: list[str]) -> list[str]:
    """Every topic a deployment with these pools and retry tiers needs."""
    topics = [topic_for_route(work_route(p, prio)) for p in pools for prio in Priority]
    topics += [topic_for_route(batch_route(p)) for p in pools]
    topics += [topic_for_route(retry_route(t)) for t in tiers]
    return [*topics, RESULTS, DLQ]
