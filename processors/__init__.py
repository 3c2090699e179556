"""The stream processors: where a job.requested message is run.

consumer (Kafka thread) -> the stages on the event loop, composed by ``pipeline``: intake
(decode; poison to calmq.dlq) -> admission (gates: spend caps, token quota, review caps,
concurrency keys, fair share; with fair share on, free slots are also filled from the
waiting room) -> claim (one statement) -> attempt (the step, under its lease: ``leases``;
a failure -> retry tier or dead letter, with ``failures`` and ``policy``) -> commit (the
group commit: status, history, outbox) -> offsets done. ``worker``, ``batcher``, ``forwarder`` and
``reaper`` are the processes, each run by calmq.supervision.Lifecycle.

Kept empty of imports: importing one module of the package (the policy, the metrics) must not
load the worker and everything it wires. Import what you need from its module, e.g.
``calmq.processors.worker.Worker``.
"""
