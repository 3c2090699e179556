"""The garbage collector's pauses are observed per generation (calmq_gc_pause_seconds): the
part of a worker's event-loop lag that is the collector, not calmq's own code; and a
service's collections are timed, small and frequent for young objects."""

from __future__ import annotations

import gc
import threading

from prometheus_client import CollectorRegistry

from calmq.cli.services import _collect, _observe_gc_pauses
from tests.support.waiting import wait_for


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


def test_the_collector_thread_collects_the_young_often_and_everything_rarely() -> None:
    """A service's collections are timed (calmq.cli.services._collect): the two young
    generations together every tick, so a survivor is walked once; all of them seldom."""
    generations: list[int] = []

    def seen(phase: str, info: dict[str, int]) -> None:
        if phase == "stop":
            generations.append(info["generation"])

    enabled = gc.isenabled()
    gc.disable()  # only the thread's collections
    gc.callbacks.append(seen)
    stop = threading.Event()
    thread = threading.Thread(target=_collect, args=(0.01, 0.3, stop), daemon=True)
    thread.start()
    try:
        wait_for(lambda: 2 in generations, timeout=10, what="a full collection")
    finally:
        stop.set()
        thread.join(timeout=10)
        gc.callbacks.remove(seen)
        if enabled:
            gc.enable()
    assert not thread.is_alive()
    first_full = generations.index(2)
    assert first_full >= 5, generations  # young ones every 0.01 s before the 0.3 s full one
    assert set(generations[:first_full]) == {1}, generations  # never the youngest alone
