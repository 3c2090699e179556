"""Offset tracking: only the contiguous completed prefix of a partition is committed."""

from __future__ import annotations

from calmq.processors.offsets import OffsetTracker

TP = ("calmq.default.bulk", 0)


def test_out_of_order_completion_commits_only_prefix() -> None:
    """With 10 and 12 done but 11 in flight, the commit position stays at 11."""
    t = OffsetTracker()
    for o in (10, 11, 12):
        t.add(TP, o)
    t.done(TP, 10)
    t.done(TP, 12)
    assert t.to_commit() == {TP: 11}
    t.committed({TP: 11})
    assert t.to_commit() == {}
    t.done(TP, 11)
    assert t.to_commit() == {TP: 13}


def test_nothing_to_commit_before_anything_completes() -> None:
    """An in-flight head offset is never committed past."""
    t = OffsetTracker()
    t.add(TP, 5)
    assert t.to_commit() == {TP: 5}
    t.committed({TP: 5})
    assert t.to_commit() == {}


def test_revoked_partition_ignores_late_completions() -> None:
    """After revoke, a completion for that partition commits nothing."""
    t = OffsetTracker()
    t.add(TP, 1)
    t.revoke(TP)
    t.done(TP, 1)
    assert t.to_commit() == {}
    assert t.in_flight() == 0


def test_in_flight_counts_pending() -> None:
    """in_flight is the number of offsets added and not yet done."""
    t = OffsetTracker()
    for o in range(100):
        t.add(TP, o)
    for o in range(0, 100, 2):
        t.done(TP, o)
    assert t.in_flight() == 50


def test_commit_lag_is_time_since_oldest_covered_completion() -> None:
    """committed() reports how long the oldest completion it covers waited for the commit."""
    now = [100.0]
    t = OffsetTracker(clock=lambda: now[0])
    for o in (0, 1, 2):
        t.add(TP, o)
    t.done(TP, 0)
    now[0] = 100.3
    t.done(TP, 2)  # not committable yet: 1 is in flight
    now[0] = 100.5
    assert t.committed(t.to_commit()) == 0.5  # covers offset 0, done at 100.0
    now[0] = 101.0
    t.done(TP, 1)
    now[0] = 101.2
    lag = t.committed(t.to_commit())  # covers 1 (done 101.0) and 2 (done 100.3)
    assert lag is not None
    assert abs(lag - 0.9) < 1e-9
    assert t.committed(t.to_commit()) is None
