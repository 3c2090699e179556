"""calmq's benchmarks: each scenario measures calmq and its baselines in the same run.

``calmq bench SCENARIO [--size N] [--json]`` runs one; ``make bench`` (``python -m
bench.run_all``) runs them all into ``bench/results/latest.json`` and BENCHMARKS.md.
Never part of the pass/fail test run.
"""

from __future__ import annotations

from bench.report import markdown_table, text_table
from bench.scenarios import DEFAULT_SIZES, SCENARIOS, NotBuiltError, run_scenario

__all__ = ["DEFAULT_SIZES", "SCENARIOS", "NotBuiltError", "markdown_table", "run_scenario",
           "text_table"]
