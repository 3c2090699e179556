"""The parallel consumer's backpressure: fetch only what fits, bulk pauses before interactive."""

from __future__ import annotations

from confluent_kafka import KafkaError, TopicPartition

from calmq.processors.consumer import ParallelConsumer

INTERACTIVE = ("calmq.p.interactive", 0)
BULK = ("calmq.p.bulk", 0)


class FakeConsumer:
    """Records pause/resume like confluent_kafka.Consumer (the only calls used here)."""

    def __init__(self) -> None:
        self.paused: set[tuple[str, int]] = set()

    def pause(self, parts: list[TopicPartition]) -> None:
        self.paused |= {(tp.topic, tp.partition) for tp in parts}

    def resume(self, parts: list[TopicPartition]) -> None:
        self.paused -= {(tp.topic, tp.partition) for tp in parts}


def _consumer(max_in_flight: int, reserve: int) -> ParallelConsumer:
    c = ParallelConsumer({}, [], lambda _b: None, max_in_flight=max_in_flight, batch_size=500,
                         interactive_reserve=reserve)
    c._assigned = {INTERACTIVE, BULK}
    return c


def test_room_never_exceeds_the_bound() -> None:
    """With 990 of 1000 in flight, at most 10 messages are fetched."""
    c = _consumer(1000, 0)
    for o in range(990):
        c.tracker.add(BULK, o)
    fake = FakeConsumer()
    assert c._backpressure(fake) == 10  # type: ignore[arg-type]
    assert fake.paused == set()


def test_full_worker_pauses_bulk_but_keeps_fetching_interactive() -> None:
    """At the bound bulk pauses; interactive still gets its reserve, then pauses too."""
    c = _consumer(4, 2)
    fake = FakeConsumer()
    for o in range(4):
        c.tracker.add(BULK, o)
    assert c._backpressure(fake) == 2  # type: ignore[arg-type]
    assert fake.paused == {BULK}
    c.tracker.add(INTERACTIVE, 0)
    c.tracker.add(INTERACTIVE, 1)
    assert c._backpressure(fake) == 0  # type: ignore[arg-type]
    assert fake.paused == {BULK, INTERACTIVE}


def test_paused_partitions_resume_when_room_frees() -> None:
    """Completions free room: interactive resumes first, bulk once below the bound again."""
    c = _consumer(4, 2)
    fake = FakeConsumer()
    for o in range(6):
        c.tracker.add(BULK, o)
    c._backpressure(fake)  # type: ignore[arg-type]
    assert fake.paused == {BULK, INTERACTIVE}
    c.tracker.done(BULK, 0)
    c._backpressure(fake)  # type: ignore[arg-type]
    assert fake.paused == {BULK}
    for o in (1, 2):
        c.tracker.done(BULK, o)
    c._backpressure(fake)  # type: ignore[arg-type]
    assert fake.paused == set()


class CommitRecorder:
    """Takes commits like confluent_kafka.Consumer.commit; an asynchronous one answers later."""

    def __init__(self) -> None:
        self.commits: list[tuple[list[tuple[str, int, int]], bool]] = []

    def commit(self, *, offsets: list[TopicPartition], asynchronous: bool) -> None:
        self.commits.append(([(tp.topic, tp.partition, tp.offset) for tp in offsets],
                             asynchronous))


def test_a_periodic_commit_is_recorded_only_when_the_broker_answers() -> None:
    """The poll loop's commit does not wait; its answer (on_commit) marks it committed."""
    c = _consumer(10, 0)
    for o in range(3):
        c.tracker.add(BULK, o)
        c.tracker.done(BULK, o)
    fake = CommitRecorder()
    c._commit(fake, asynchronous=True)  # type: ignore[arg-type]
    assert fake.commits == [([(*BULK, 3)], True)]
    assert c.tracker.to_commit() == {BULK: 3}  # not known to be committed yet
    c._on_commit(None, [TopicPartition(*BULK, 3)])
    assert c.tracker.to_commit() == {}
    c._commit(fake)  # type: ignore[arg-type]  # nothing new: no second commit
    assert len(fake.commits) == 1


def test_a_failed_periodic_commit_is_sent_again() -> None:
    """A commit the broker refused is not recorded, so the next interval sends it again."""
    c = _consumer(10, 0)
    c.tracker.add(BULK, 0)
    c.tracker.done(BULK, 0)
    fake = CommitRecorder()
    c._commit(fake, asynchronous=True)  # type: ignore[arg-type]
    c._on_commit(KafkaError(KafkaError.REBALANCE_IN_PROGRESS), [TopicPartition(*BULK, 1)])
    c._commit(fake, asynchronous=True)  # type: ignore[arg-type]
    assert fake.commits == [([(*BULK, 1)], True), ([(*BULK, 1)], True)]
