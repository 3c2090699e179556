"""The garbage collector's pauses are observed per generation (calmq_gc_pause_seconds): the
part of a worker's event-loop lag that is the collector, not calmq's own code."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry

from calmq.cli.services import _observe_gc_pauses


def _count(registry: CollectorRegistry, generation: str) -> float:
    value = registry.get_sample_value("calmq_gc_pause_seconds_count",
                                      {"generation": generation})
    return 0.0 if value is None else value


def test_each_collection_is_observed_under_its_generation() -> None:
    registry = CollectorRegistry()
    callback = _observe_gc_pauses(registry)
    enabled = gc.isenabled()
    gc.disable()  # only the collections this test asks for
    try:
        before = _count(registry, "2")
        young = _count(registry, "0")
        gc.collect(2)
        gc.collect(2)
        assert _count(registry, "2") == before + 2
        assert _count(registry, "0") == young  # a full collection is not counted as young
        total = registry.get_sample_value("calmq_gc_pause_seconds_sum", {"generation": "2"})
        assert total is not None
        assert total > 0
    finally:
        gc.callbacks.remove(callback)
        if enabled:
            gc.enable()
