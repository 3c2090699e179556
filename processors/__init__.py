"""The stream processors: where a job.requested message is run.

consumer (Kafka thread) -> runner (asyncio: claim, run the step, group-commit the outcome)
-> the outbox (results, retry tiers, dead letters). ``policy`` decides retry or dead letter.
"""

from calmq.processors.policy import Backoff, RetryDecision, decide
from calmq.processors.worker import Worker

__all__ = ["Backoff", "RetryDecision", "Worker", "decide"]
