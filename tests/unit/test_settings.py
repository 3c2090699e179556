"""Settings: read from CALMQ_* and flags; unknown keys and bad values are errors."""

from __future__ import annotations

import pytest

from calmq.errors import ConfigError
from calmq.settings import Settings, parse_duration


def test_environment_values_are_read() -> None:
    """CALMQ_CONCURRENCY and CALMQ_POOL reach the settings, typed."""
    s = Settings.load(environ={"CALMQ_CONCURRENCY": "64", "CALMQ_POOL": "ocr"})
    assert s.concurrency == 64
    assert s.pool == "ocr"


def test_flags_win_over_environment() -> None:
    """A flag overrides the environment variable of the same setting."""
    s = Settings.load({"concurrency": 8}, environ={"CALMQ_CONCURRENCY": "64"})
    assert s.concurrency == 8


def test_unknown_environment_setting_is_an_error() -> None:
    """A misspelt CALMQ_ variable is named in the error instead of being ignored."""
    with pytest.raises(ConfigError) as info:
        Settings.load(environ={"CALMQ_CONCURENCY": "64"})
    assert info.value.code == "unknown_setting"
    assert "CALMQ_CONCURENCY" in info.value.message


def test_unknown_flag_setting_is_an_error() -> None:
    """An override that is no setting is rejected."""
    with pytest.raises(ConfigError):
        Settings.load({"nonsense": 1}, environ={})


def test_invalid_value_names_the_setting() -> None:
    """A value of the wrong type names the setting it belongs to."""
    with pytest.raises(ConfigError) as info:
        Settings.load(environ={"CALMQ_CONCURRENCY": "many"})
    assert "concurrency" in info.value.message


def test_priorities_and_tiers_are_checked() -> None:
    """Priorities must be interactive/bulk; retry tiers must be increasing durations."""
    with pytest.raises(ConfigError):
        Settings.load(environ={"CALMQ_PRIORITIES": "urgent"})
    with pytest.raises(ConfigError):
        Settings.load(environ={"CALMQ_RETRY_TIERS": "30s,5s"})
    s = Settings.load(environ={"CALMQ_RETRY_TIERS": "1s,10s"})
    assert s.retry_tier_list == [("1s", 1.0), ("10s", 10.0)]


@pytest.mark.parametrize(
    ("text", "seconds"), [("250ms", 0.25), ("5s", 5), ("2m", 120), ("1h", 3600), ("7", 7)]
)
def test_parse_duration(text: str, seconds: float) -> None:
    """Durations read with ms, s, m, h suffixes or as plain seconds."""
    assert parse_duration(text) == seconds


def test_parse_duration_rejects_garbage() -> None:
    """A duration that is not one says how to write it."""
    with pytest.raises(ConfigError, match="duration"):
        parse_duration("soon")
