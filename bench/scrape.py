"""Read a calmq process's /metrics (Prometheus text) for the figures only it knows: event-loop
lag, commit lag, lease expiries."""

from __future__ import annotations

import math
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

__all__ = ["Scrape", "scrape"]


class Scrape:
    """One scrape: samples by name, labels dropped (bench processes use no labels that
    matter for these figures, so same-named samples are summed)."""

    def __init__(self, text: str) -> None:
        self.values: dict[str, float] = {}
        self.buckets: dict[str, list[tuple[float, float]]] = {}
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    le = float(s.labels["le"])
                    rows = self.buckets.setdefault(s.name.removesuffix("_bucket"), [])
                    for i, (bound, count) in enumerate(rows):
                        if bound == le:
                            rows[i] = (bound, count + s.value)
                            break
                    else:
                        rows.append((le, s.value))
                else:
                    self.values[s.name] = self.values.get(s.name, 0.0) + s.value

    def value(self, name: str) -> float:
        return self.values.get(name, 0.0)

    def quantile(self, name: str, q: float) -> float:
        """Prometheus's histogram_quantile: linear inside the bucket holding the q-th
        observation; the last finite bound when it falls in +Inf; 0 with no observations."""
        rows = sorted(self.buckets.get(name, []))
        if not rows or rows[-1][1] == 0:
            return 0.0
        rank = q * rows[-1][1]
        lower, below = 0.0, 0.0
        for bound, count in rows:
            if count >= rank:
                if math.isinf(bound):
                    return lower
                inside = count - below
                return lower + (bound - lower) * ((rank - below) / inside if inside else 1.0)
            lower, below = bound, count
        return lower


def scrape(url: str) -> Scrape:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:
        return Scrape(resp.read().decode())
