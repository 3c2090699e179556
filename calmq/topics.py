"""Kafka topic names, derived in one place so every component agrees on where a message goes.

Work:        calmq.<pool>.<priority>      job.requested events, consumed by processors
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
    "DLQ",
    "DLQ_ROUTE",
    "PREFIX",
    "RESULTS",
    "RESULTS_ROUTE",
    "all_topics",
    "retry_route",
    "topic_for_route",
    "work_route",
]

PREFIX = "calmq."
RESULTS_ROUTE = "results"
DLQ_ROUTE = "dlq"
RESULTS = PREFIX + RESULTS_ROUTE
DLQ = PREFIX + DLQ_ROUTE


def work_route(pool: str, priority: Priority | str) -> str:
    return f"{pool}.{Priority(priority).value}"


def retry_route(tier: str) -> str:
    return f"retry.{tier}"


def topic_for_route(route: str) -> str:
    return PREFIX + route


def all_topics(pools: list[str], tiers: list[str]) -> list[str]:
    """Every topic a deployment with these pools and retry tiers needs."""
    topics = [topic_for_route(work_route(p, prio)) for p in pools for prio in Priority]
    topics += [topic_for_route(retry_route(t)) for t in tiers]
    return [*topics, RESULTS, DLQ]
