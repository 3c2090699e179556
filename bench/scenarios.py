"""The scenario registry: each name, the function that runs it and its default size.

A scenario lives in a module of its own (bench/accept.py, relay.py, e2e.py, slow.py,
drain.py, budget.py, priority.py, longcalls.py, batch_lane.py, logical_messages.py,
happy_path.py, streaming.py, scale.py, fairness.py, bulk.py, tiers.py); each
starts its own stack, runs calmq, then its baselines on the same broker and database, and
returns one result of the one shape docs/how-to/benchmarks.md describes. What they share is
bench/common.py. Modules are imported when their scenario runs, so `calmq bench e2e` loads
only what e2e needs.

Every rate is a ratio against a baseline measured minutes apart on the same machine, because
absolute figures on a shared 2-core machine drift from run to run.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import DISPATCH_RUNS, Log, NotBuiltError, stderr
from bench.procs import Sampler
from bench.report import machine

__all__ = ["DEFAULT_SIZES", "DISPATCH_RUNS", "SCENARIOS", "NotBuiltError", "run_scenario"]

# budget: more jobs than three minutes of quota can serve, so demand exceeds the budget.
DEFAULT_SIZES = {"accept": 4000, "relay": 20000, "e2e": 5000, "slow": 10000, "drain": 10000,
                 "budget": 1500, "priority": 50_000, "longcalls": 60_000, "batch": 20_000,
                 "logical_messages": 50_000, "happy_path": 20_000, "streaming": 200,
                 "scale": 20_000_000, "fairness": 12_000, "rerun": 1000, "bulk": 40_000,
                 "fanout": 100_000, "tiers": 2000}


def _lazy(module: str, function: str) -> Callable[..., dict[str, Any]]:
    def run(size: int, log: Log, sampler: Sampler, **kw: Any) -> dict[str, Any]:
        found: Callable[..., dict[str, Any]] = getattr(
            importlib.import_module(f"bench.{module}"), function)
        return found(size, log, sampler, **kw)

    run.__name__ = function
    return run


SCENARIOS: dict[str, Callable[..., dict[str, Any]]] = {
    "accept": _lazy("accept", "accept"), "relay": _lazy("relay", "relay"),
    "e2e": _lazy("e2e", "e2e"), "slow": _lazy("slow", "slow"),
    "drain": _lazy("drain", "drain"), "budget": _lazy("budget", "budget"),
    "priority": _lazy("priority", "priority"), "longcalls": _lazy("longcalls", "longcalls"),
    # the batch lane's three phases; an A/B of the outbox's write path
    "batch": _lazy("batch_lane", "batch"),
    "logical_messages": _lazy("logical_messages", "logical_messages"),
    # an A/B of the ordinary path's history: event rows, or none
    "happy_path": _lazy("happy_path", "happy_path"),
    # time to first token through calmq, streaming's CPU, and a transport beside it
    "streaming": _lazy("streaming", "streaming"),
    # month six: an empty and a preloaded database side by side, then a steady run
    "scale": _lazy("scale", "scale"),
    # issue 31: one tenant behind another's backlog in one lane, and weighted shares
    "fairness": _lazy("fairness", "fairness"),
    # issue 43: the interactive tail while `calmq jobs rerun` reruns a tenant's jobs
    "rerun": _lazy("rerun", "rerun"),
    # issue 43: a backfill file through `calmq submit --file` against single POSTs
    "bulk": _lazy("bulk", "bulk"),
    # issue 43: one parent's children against as many independent jobs, and the join
    "fanout": _lazy("fanout", "fanout"),
    # issue 46: the deadline picks the service tier, against the same work all at standard
    "tiers": _lazy("tiers", "tiers"),
}


def run_scenario(name: str, size: int | None = None, *, log: Log = stderr,
                 profile_dir: Path | None = None, runs: int | None = None,
                 steady_seconds: float | None = None,
                 kill: str | None = None) -> dict[str, Any]:
    """Run one scenario and return its result; raises NotBuiltError for one not built yet.
    ``runs``: how many dispatch runs (e2e: 5 by default, the target is the median run;
    scale: 24 a database by default, in pairs);
    ``steady_seconds``: scale's steady run (default: 30 minutes, a minute for a smoke size);
    ``kill``: fanout's process to kill -9 when half the children are done (worker, relay)."""
    if name not in SCENARIOS:
        raise NotBuiltError(f"unknown scenario {name!r}; choose from {', '.join(SCENARIOS)}")
    size = size or DEFAULT_SIZES[name]
    info = machine()
    sampler = Sampler()
    try:
        log(f"bench {name} (size {size})")
        extra: dict[str, Any] = {} if steady_seconds is None else {
            "steady_seconds": steady_seconds}
        if runs is not None:
            extra["runs"] = runs
        if kill is not None:
            extra["kill"] = kill
        res = SCENARIOS[name](size, log=log, sampler=sampler, profile_dir=profile_dir, **extra)
    finally:
        sampler.close()
    res["machine"] = info
    return res
