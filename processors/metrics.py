"""Worker metrics. Labels are bounded: status, failure class and retry tier only."""

from __future__ import annotations

from typing import Any

from prometheus_client import Counter, Gauge, Histogram

__all__ = [
    "ABORTED",
    "CLAIM_SECONDS",
    "COMMIT_LAG",
    "COMMIT_LAG_LAST",
    "CONCURRENCY_KEY_HELD",
    "CONCURRENCY_KEY_RESUMED",
    "CONSUMER_LAG",
    "DEADLINES_MISSED",
    "DEAD_LETTERS",
    "FAIR_SHARE_HELD",
    "FAIR_SHARE_PICKED",
    "FENCED",
    "FORWARDED",
    "FORWARDER_HELD",
    "GROUP_SIZE",
    "GROUP_WRITE_SECONDS",
    "IN_FLIGHT",
    "JOBS_SWEPT",
    "JOB_ATTEMPTS",
    "JOB_LATENCY",
    "LEASE_EXPIRATIONS",
    "LOOP_LAG",
    "MODEL_SECONDS",
    "OTHER_SECONDS",
    "POISON",
    "RETRIES",
    "RETRY_DELAY",
    "SATURATION",
    "SKIPPED",
    "STEP_SECONDS",
    "UNSTORABLE",
    "WAITED_UNCOUNTED",
    "WAIT_RESUMED",
    "finished",
]

FINISHED = Counter("calmq_attempts_finished_total", "Attempts finished, by outcome status",
                   ["status", "failure_class"])
RETRIES = Counter("calmq_retries_total", "Retries scheduled", ["failure_class", "tier"])
SKIPPED = Counter("calmq_redeliveries_acked_total",
                  "Messages acknowledged without a model call (terminal or leased job)")
CLAIMS_DEFERRED = Counter("calmq_claims_deferred_total",
                          "Messages claimed again later: their job was not visible yet")
REVIEW_CAP_HELD = Counter("calmq_review_cap_held_total",
                          "Messages of jobs held in queued: their pool was at its review cap")
# The caps this worker enforces, as last read (every ReviewCapGate.CAPS_TTL seconds): a cap
# set or changed takes effect once every worker shows it here.
REVIEW_CAP = Gauge("calmq_review_cap", "Review cap of each pool, as this worker last read it",
                   ["pool"])
REVIEW_CAP_RESUMED = Counter("calmq_review_cap_resumed_total",
                             "Jobs held for a review cap re-published as room freed")
CONCURRENCY_KEY_HELD = Counter("calmq_concurrency_key_held_total",
                               "Jobs held in queued: their concurrency key had its workflow's "
                               "limit in flight")
CONCURRENCY_KEY_RESUMED = Counter("calmq_concurrency_key_resumed_total",
                                  "Jobs held for their concurrency key re-published as its "
                                  "jobs ended")
CONCURRENCY_KEYS_OVERFLOW = Counter("calmq_concurrency_keys_waiting_total",
                                   "Jobs held behind their tenant's concurrency keys: its "
                                   "jobs waited for concurrency_keys_waiting_max keys already")
WAITED_UNCOUNTED = Counter("calmq_waited_uncounted_total",
                           "Attempts handed back uncounted to wait in queued: every model "
                           "their step allows cooling down after a 429 (model_cooldown), or "
                           "their concurrency key at its rate limit (rate_limit_key)",
                           ["reason"])
WAIT_RESUMED = Counter("calmq_wait_resumed_total",
                       "Jobs re-published once their wait (model_cooldown, rate_limit_key) "
                       "was over", ["reason"])
FAIR_SHARE_HELD = Counter("calmq_fair_share_held_total",
                          "Jobs held in their queue's waiting room (setting fair_share): the queue"
                          " was contended", ["priority"])
FAIR_SHARE_PICKED = Counter("calmq_fair_share_picked_total",
                            "Jobs this worker took from its queues' waiting rooms into free slots",
                            ["priority"])
POISON = Counter("calmq_poison_messages_total", "Unreadable messages sent to calmq.dlq")
UNSTORABLE = Counter("calmq_unstorable_outputs_total",
                     "Attempts failed as unstorable_output: their result held text PostgreSQL "
                     "refuses (a NUL, a lone surrogate)")
ABORTED = Counter("calmq_attempts_aborted_total", "In-flight attempts aborted: lease lost")
# ``reason``: heartbeat_failed (the worker stopped the attempt itself: its heartbeats failed
# for most of a lease), stale_outcome (the database refused the outcome: a newer claim, a
# reaper or a cancel took the job), stale_write (it refused a side-effect log write).
FENCED = Counter("calmq_attempts_fenced_total",
                 "Attempts stopped or refused because they no longer held their job's lease",
                 ["reason"])
STEP_SECONDS = Histogram("calmq_step_seconds", "Time in a step attempt",
                         buckets=(0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300))
IN_FLIGHT = Gauge("calmq_worker_in_flight",
                  "Jobs claimed by this worker (in a step, or about to be)")
SATURATION = Gauge("calmq_worker_saturation", "Call slots in use / concurrency")
# Seconds from a message's completion to the commit of its offset (the oldest one of each
# commit): what a crash would make the next consumer redo, measured in time.
COMMIT_LAG = Histogram("calmq_commit_lag_seconds",
                       "Completion-to-commit delay of the oldest offset in each commit",
                       # to 300 s: with long-tailed calls the committed prefix waits
                       # for the slowest call in it (bench longcalls)
                       buckets=(0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10, 30, 60, 120,
                                300))
COMMIT_LAG_LAST = Gauge("calmq_commit_lag_last_seconds",
                        "Completion-to-commit delay of the oldest offset in the last commit")
GROUP_WRITE_SECONDS = Histogram("calmq_group_commit_seconds",
                                "Time to write one group of outcomes (one transaction)",
                                buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
GROUP_SIZE = Histogram("calmq_group_commit_size", "Outcomes per group commit",
                       buckets=(1, 5, 20, 50, 100, 200, 500, 1000))
CLAIM_SECONDS = Histogram("calmq_claim_seconds", "Time to claim one polled batch",
                          buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5))
# Accept (job row created) to completed, observed when the worker hands the completion to
# the group commit (a few ms before it is durable). Slow AI jobs: buckets up to an hour.
_LONG = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
JOB_LATENCY = Histogram("calmq_job_latency_seconds", "Accept to completion of completed jobs",
                        ["workflow"], buckets=_LONG)
JOB_ATTEMPTS = Histogram("calmq_job_attempts", "Attempts the completing step of a job took",
                         ["workflow"], buckets=(1, 2, 3, 4, 5, 7, 10, 20))
_ATTEMPT = (0.001, 0.005, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 300)
MODEL_SECONDS = Histogram("calmq_attempt_model_seconds",
                          "Time an attempt waited for the model provider's answers",
                          ["workflow"], buckets=_ATTEMPT)
OTHER_SECONDS = Histogram("calmq_attempt_other_seconds",
                          "Time of an attempt not spent in model calls (budget wait, I/O, code)",
                          ["workflow"], buckets=_ATTEMPT)
RETRY_DELAY = Histogram("calmq_retry_delay_seconds", "Delay chosen for each scheduled retry",
                        ["failure_class"], buckets=(0.5, 1, 2, 5, 10, 30, 60, 300, 900, 3600))
# A job that ended (completed or dead-lettered) after its deadline, or was dead-lettered
# because it passed (deadline_exceeded): named in its history too (processors/deadlines.py).
DEADLINES_MISSED = Counter("calmq_deadlines_missed_total",
                           "Jobs that ended past their deadline_seconds, by how they ended",
                           ["workflow", "priority", "status"])
DEAD_LETTERS = Counter("calmq_dead_letters_total", "Jobs dead-lettered by a worker",
                       ["failure_class"])
# How late the worker's event loop runs a 0.1 s timer: every callback (a model answer, a
# claim, a heartbeat) waits that long too. Thousands of calls in flight on one loop show here
# first.
LOOP_LAG = Histogram("calmq_event_loop_lag_seconds",
                     "Delay of the worker's event loop past a 0.1 s timer",
                     buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5))
LEASE_EXPIRATIONS = Counter("calmq_lease_expirations_total",
                            "Jobs requeued by the reaper because their worker's lease expired")
# ``pool``: a configured routing pool (a handful).
HELD = Counter("calmq_jobs_held_total",
               "Jobs that waited instead of being claimed: their tenant or the fleet is past"
               " a spend cap", ["priority"])
RELEASED = Counter("calmq_jobs_released_total",
                   "Waiting jobs re-published once no spend cap held them any more")
# Cost of attempts by what they were: a job's first attempt of a step, a retry, the attempt
# that dead-lettered it, or one stopped before its outcome (lease lost, shutdown). The sum
# over kinds is what the fleet spent; divided by calmq_job_cost_jobs_total, the cost per job.
JOB_COST = Counter("calmq_job_cost_usd_total",
                   "Model cost of attempts in USD, by workflow, tenant and kind of attempt",
                   ["workflow", "tenant", "kind"])
JOB_COST_JOBS = Counter("calmq_job_cost_jobs_total",
                        "Jobs that ended (completed or dead-lettered), by workflow and tenant",
                        ["workflow", "tenant"])
JOBS_SWEPT = Counter("calmq_jobs_swept_total",
                     "Waiting jobs the sweeper re-published because no message carried them",
                     ["pool"])
CONSUMER_LAG = Gauge("calmq_consumer_lag_messages",
                     "High watermark minus committed offset, summed over assigned partitions",
                     ["topic"])
FORWARDED = Counter("calmq_forwarder_republished_total",
                    "Retry messages republished to their origin topic")
FORWARDER_HELD = Gauge("calmq_forwarder_held_partitions",
                       "Retry-tier partitions paused until their head is due")


def finished(status: str, error: dict[str, Any] | None) -> None:
    FINISHED.labels(status, (error or {}).get("class", "")).inc()
