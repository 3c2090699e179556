"""The stream processors: where a job.requested message is run.

consumer (Kafka thread) -> runner (asyncio: claim, run the step, group-commit the outcome)
-> failures (retry tier or dead letter, with ``policy``) -> the outbox (results, retry tiers,
dead letters).

Kept empty of imports: importing one module of the package (the policy, the metrics) must not
load the worker and everything it wires. Import what you need from its module, e.g.
``calmq.processors.worker.Worker``.
"""
