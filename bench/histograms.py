"""The workers' histograms that split an interactive attempt, scraped before and after a
measured pass (``calmq bench priority`` and ``rerun``): the budget wait by priority, the
provider's answers, the rest of the attempt, and the event loop's lag. Where a tail's time
goes inside the attempt, these say."""

from __future__ import annotations

import math
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from bench.rig import Rig

__all__ = ["Buckets", "quantiles", "scrape"]

# The workers' histograms that split an attempt: budget wait by priority, the provider's
# answers, the rest of the attempt, and the event loop's lag.
_HISTOGRAMS = ("calmq_budget_wait_seconds", "calmq_attempt_model_seconds",
               "calmq_attempt_other_seconds", "calmq_event_loop_lag_seconds")
Buckets = dict[str, dict[float, float]]


def scrape(rig: Rig, names: list[str]) -> Buckets:
    """The workers' _HISTOGRAMS summed over workers, by priority where labelled."""
    out: Buckets = {}
    for name in names:
        url = rig.procs[name].url
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        for family in text_string_to_metric_families(text):
            if family.name not in _HISTOGRAMS:
                continue
            for sample in family.samples:
                key = family.name + (f":{sample.labels['priority']}"
                                     if "priority" in sample.labels else "")
                # le: the bucket's bound; -1: the sum of the observations
                if sample.name.endswith("_bucket"):
                    le = float(sample.labels["le"])
                elif sample.name.endswith("_sum"):
                    le = -1.0
                else:
                    continue
                rows = out.setdefault(key, {})
                rows[le] = rows.get(le, 0.0) + sample.value
    return out


def quantiles(before: Buckets, after: Buckets) -> dict[str, dict[str, float]]:
    """p50 and p99 (upper bucket bound, ms), mean (ms) and count of each histogram
    between scrapes."""
    out: dict[str, dict[str, float]] = {}
    for key, rows in after.items():
        diff = sorted((le, n - before.get(key, {}).get(le, 0.0)) for le, n in rows.items())
        summed = next((n for le, n in diff if le < 0), 0.0)
        diff = [(le, n) for le, n in diff if le >= 0]
        total = diff[-1][1] if diff else 0.0
        if total <= 0:
            continue

        def bound(q: float, rows: list[tuple[float, float]] = diff, n: float = total) -> float:
            le = next(le for le, c in rows if c >= q * n)
            return round(le * 1000, 1) if not math.isinf(le) else math.inf

        out[key.removeprefix("calmq_")] = {"p50_ms_le": bound(0.5), "p99_ms_le": bound(0.99),
                                           "mean_ms": round(summed * 1000 / total, 1),
                                           "count": round(total)}
    return out
