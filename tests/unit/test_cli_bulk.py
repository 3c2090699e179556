"""The bulk engine's parts that need no stack: progress, checkpoint, frozen bound, summary."""

from __future__ import annotations

import io
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from calmq.cli.bulk import Checkpoint, FrozenFilter, Progress, pinned, summary_line
from calmq.errors import ConfigError


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_plain_progress_prints_a_line_per_tenth_with_rate_and_eta() -> None:
    out, clock = io.StringIO(), _Clock()
    progress = Progress("redrive", 100, out=out, tty=False, clock=clock)
    for _ in range(100):
        clock.now += 0.1  # 10 jobs per second
        progress.advance()
    progress.finish()
    lines = out.getvalue().splitlines()
    assert len(lines) == 10  # every tenth of the work; finish adds nothing new
    assert lines[0] == "redrive: 10/100 (10%), 10.0 jobs/s, ETA 0:09"
    assert lines[-1] == "redrive: 100/100 (100%), 10.0 jobs/s, ETA 0:00"


def test_plain_progress_also_prints_every_few_seconds_when_slow() -> None:
    out, clock = io.StringIO(), _Clock()
    progress = Progress("cancel", 10_000, out=out, tty=False, clock=clock)
    for _ in range(3):
        clock.now += 6  # far from a tenth of 10,000, but seconds pass
        progress.advance()
    assert out.getvalue().splitlines()[0].startswith("cancel: 1/10000 (0%)")
    assert len(out.getvalue().splitlines()) == 3


def test_terminal_progress_redraws_one_bar_in_place() -> None:
    out, clock = io.StringIO(), _Clock()
    progress = Progress("redrive", 4, out=out, tty=True, clock=clock)
    for _ in range(2):
        clock.now += 1
        progress.advance()
    drawn = out.getvalue()
    assert drawn.count("\r\x1b[2K") == 2  # each redraw clears the line: no scrolling
    assert drawn.rsplit("\r\x1b[2K", 1)[1] == (
        "redrive [###############...............] 2/4  50%    1.0/s ETA 0:02")
    progress.finish()
    assert out.getvalue().endswith("\n")


def test_checkpoint_round_trip_and_refusals(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "c.json"
    key = (datetime(2026, 12, 1, 23, 0, 0, 123456, tzinfo=UTC), uuid.uuid4())
    saved = Checkpoint(path=path, command="dlq redrive", params={"code": "x", "until": "t"},
                       started_at="s", after=key, done=5)
    saved.skipped["not_dead_lettered"] += 2
    saved.failed["unknown_workflow"] += 1
    saved.save()
    loaded = Checkpoint.load(path, "dlq redrive")
    assert (loaded.after, loaded.done, loaded.params, loaded.finished) == (
        key, 5, {"code": "x", "until": "t"}, False)
    assert (dict(loaded.skipped), dict(loaded.failed)) == (
        {"not_dead_lettered": 2}, {"unknown_workflow": 1})
    assert not (tmp_path / "sub" / "c.json.tmp").exists()  # written by rename

    with pytest.raises(ConfigError) as wrong:
        Checkpoint.load(path, "jobs cancel")
    assert wrong.value.code == "invalid_checkpoint"
    with pytest.raises(ConfigError) as missing:
        Checkpoint.load(tmp_path / "nope.json", "dlq redrive")
    assert missing.value.code == "checkpoint_not_found"


def test_the_upper_bound_is_frozen_at_the_start() -> None:
    now = datetime(2026, 12, 1, tzinfo=UTC)
    assert pinned(None, now) == now
    assert pinned(now + timedelta(days=1), now) == now  # a future bound would sweep in more
    assert pinned(now - timedelta(hours=1), now) == now - timedelta(hours=1)


def test_summary_line_names_each_reason() -> None:
    assert summary_line(3, "redriven", {}, {}) == "3 redriven"
    assert summary_line(1, "cancelled", {"job_terminal": 2}, {"not_found": 1, "bad": 1}) == (
        "1 cancelled, 2 skipped (job_terminal: 2), 2 failed (bad: 1, not_found: 1)")


def test_filter_times_are_iso_or_a_duration_ago() -> None:
    from calmq.cli.times import when

    assert when("2026-12-01T10:00") == datetime(2026, 12, 1, 10, tzinfo=UTC)  # no zone: UTC
    ago = when("2h")
    assert ago is not None
    assert abs((datetime.now(UTC) - ago) - timedelta(hours=2)) < timedelta(seconds=5)
    with pytest.raises(ConfigError) as bad:
        when("yesterday")
    assert bad.value.code == "invalid_time"


def _redrive_filter() -> FrozenFilter:
    from calmq.cli.deadletters import _FILTERS, _filter

    return FrozenFilter(keys=frozenset({*_FILTERS, "reason", "by"}), filters=frozenset(_FILTERS),
                        pinned="until", parse=lambda p: _filter(p, 1))


@pytest.mark.parametrize(("params", "why"), [
    ({"until": "2026-01-01T00:00:00+00:00", "tenant": "acme", "reason": "r", "by": "me",
      "limit_everything": True}, "keys this command does not write"),
    ({"until": "2027-01-01T00:00:00+00:00", "code": "x", "reason": "r"}, "not frozen"),
    ({"until": "2026-06-01T00:00:00+00:00", "reason": "r"}, "no filter"),
    ({"until": "2026-01-01T00:00:00+00:00", "failure_class": "nope", "reason": "r"},
     "not valid"),
    ({"code": "x", "reason": "r"}, "not a time"),
])
def test_a_resumed_checkpoint_is_held_to_the_commands_filter(
        tmp_path: Path, params: dict[str, object], why: str) -> None:
    """--resume refuses a checkpoint whose filter the command would not have written: an
    unknown key, a bound past the run's start, no filter at all, an invalid value."""
    started = "2026-06-01T00:00:00+00:00"
    with pytest.raises(ConfigError) as caught:
        _redrive_filter().check(tmp_path / "c.json", params, started)
    assert caught.value.code == "invalid_checkpoint"
    assert why in caught.value.message


def test_a_checkpoint_the_command_wrote_is_resumed() -> None:
    """The filter of a real run (frozen bound, a narrowing filter) passes the check."""
    _redrive_filter().check(Path("c.json"), {
        "until": "2026-06-01T00:00:00+00:00", "since": None, "code": "timeout",
        "tenant": "acme", "reason": "provider back", "by": "me"}, "2026-06-01T00:00:00+00:00")
