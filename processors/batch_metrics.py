"""The batch lane's metrics: its packer's (processors/batch_packer.py), its poller's
(processors/batch_poller.py) and the lane's gauges (processors/batcher.py)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

OPEN_BATCHES = Gauge("calmq_batches_open", "Provider batches not yet collected")
OLDEST_BATCH = Gauge("calmq_batch_oldest_age_seconds", "Age of the oldest open provider batch")
BATCH_JOBS = Gauge("calmq_batch_jobs", "Job attempts in provider batches (open, or settled "
                   "in the last hour) by state", ["state"])
PACKED = Counter("calmq_batch_jobs_packed_total", "Job attempts packed into provider batches")
CREATED = Counter("calmq_batches_created_total", "Provider batches created", ["provider"])
ADOPTED = Counter("calmq_batches_adopted_total",
                  "Batches found again at the provider after their batcher died")
SETTLED = Counter("calmq_batch_jobs_settled_total", "Batch results settled", ["result"])
TURNAROUND = Histogram("calmq_batch_turnaround_seconds",
                       "From a batch's creation to its collection",
                       buckets=(1, 5, 30, 60, 300, 900, 3600, 4 * 3600, 12 * 3600, 86400))
COST = Counter("calmq_batch_cost_usd_total", "Cost of batched requests at the batch price",
               ["tenant", "model"])
ONLINE_COST = Counter("calmq_batch_online_equivalent_usd_total",
                      "What the batched requests' tokens would have cost online",
                      ["tenant", "model"])
SAVINGS = Counter("calmq_batch_savings_usd_total",
                  "Online-equivalent cost minus batch cost of batched requests",
                  ["tenant", "model"])
DELETED = Counter("calmq_batch_files_deleted_total",
                  "Ended provider batches whose files (or batch) calmq deleted at the provider")
UNREADABLE = Counter("calmq_batch_unreadable_lines_total",
                     "Lines of a provider's results file that named no request (skipped)")
SPEND_HELD = Counter("calmq_batch_jobs_spend_held_total",
                     "Packed requests not sent because their tenant or the fleet reached a "
                     "spend cap with what is spent and reserved (their jobs wait, uncounted)",
                     ["reason"])
RESERVED = Gauge("calmq_batch_reserved_usd",
                 "Estimated cost of batched requests not yet settled, reserved against the "
                 "spend caps")
