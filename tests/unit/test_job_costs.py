"""Cost per accepted job (calmq.job_costs, calmq.data.operations.JobCosts): counted once per
completed job with its whole cost, and shown beside the cost per job."""

from __future__ import annotations

import uuid

import pytest
from prometheus_client import REGISTRY

from calmq.data.operations import JobCosts
from calmq.job_costs import Accepted, count_accepted
from calmq.producers.console.shaping import job_costs_view


def test_cost_per_accepted_job_beside_cost_per_job() -> None:
    """Per job spreads every ended job's cost; per accepted job, the completed jobs' own."""
    row = JobCosts("handbook", "acme", jobs=4, cost_usd=0.4, accepted=2,
                   accepted_cost_usd=0.3, input_tokens=10_000, cached_input_tokens=9_000,
                   cache_write_tokens=500, cache_saved_usd=0.02)
    assert row.cost_per_job == pytest.approx(0.1)
    assert row.cost_per_accepted_job == pytest.approx(0.15)
    assert row.cached_share == pytest.approx(0.9)
    shown = row.as_dict()
    assert shown["cost_per_accepted_job_usd"] == pytest.approx(0.15)
    assert shown["cached_share"] == 0.9
    none = JobCosts("handbook", "acme", 1, 0.1, 0, 0.0, 0, 0, 0, 0.0)
    assert (none.cost_per_accepted_job, none.cached_share) == (None, None)
    assert job_costs_view([row, none]) == [
        ["handbook", "acme", "4", "0.100000", "2", "0.150000", "90.0%", "0.020000"],
        ["handbook", "acme", "1", "0.100000", "0", "-", "-", "0.000000"]]


def test_an_accepted_job_is_counted_with_its_whole_cost() -> None:
    """The counters add the job's cost and one job, under its workflow and tenant."""
    tenant = uuid.uuid4()
    labels = {"workflow": "handbook", "tenant": str(tenant)}
    count_accepted([Accepted(uuid.uuid4(), "handbook", tenant, 0.25),
                    Accepted(uuid.uuid4(), "handbook", tenant, 0.05)])
    assert REGISTRY.get_sample_value("calmq_job_accepted_cost_usd_total",
                                     labels) == pytest.approx(0.3)
    assert REGISTRY.get_sample_value("calmq_job_accepted_jobs_total", labels) == 2
