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


# What Kubernetes injects into a pod for a Service named calmq-api (10.0.0.1:8080) and one
# named calmq (port named http), when the pod does not set enableServiceLinks: false.
SERVICE_LINKS = {
    "CALMQ_API_SERVICE_HOST": "10.0.0.1",
    "CALMQ_API_SERVICE_PORT": "8080",
    "CALMQ_API_SERVICE_PORT_HTTP": "8080",
    "CALMQ_API_PORT": "tcp://10.0.0.1:8080",
    "CALMQ_API_PORT_8080_TCP": "tcp://10.0.0.1:8080",
    "CALMQ_API_PORT_8080_TCP_PROTO": "tcp",
    "CALMQ_API_PORT_8080_TCP_PORT": "8080",
    "CALMQ_API_PORT_8080_TCP_ADDR": "10.0.0.1",
    "CALMQ_SERVICE_HOST": "10.0.0.2",
    "CALMQ_SERVICE_PORT": "80",
    "CALMQ_PORT": "tcp://10.0.0.2:80",
    "CALMQ_PORT_80_TCP": "tcp://10.0.0.2:80",
}


def test_kubernetes_service_links_are_not_settings(caplog: pytest.LogCaptureFixture) -> None:
    """Service-link variables load without error, leave api_port alone and name the cause."""
    import calmq.settings as module

    module._warned_links = False  # the warning is once per process
    with caplog.at_level("WARNING", logger="calmq.settings"):
        s = Settings.load(environ={**SERVICE_LINKS, "CALMQ_CONCURRENCY": "4"})
        Settings.load(environ=SERVICE_LINKS)
    assert s.api_port == 8080  # the default, not tcp://10.0.0.1:8080
    assert s.concurrency == 4
    [record] = [r for r in caplog.records if "service links" in r.getMessage()]
    assert "enableServiceLinks: false" in record.getMessage()
    assert "CALMQ_API_PORT_8080_TCP_ADDR" in record.getMessage()


def test_service_links_from_the_process_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same holds when pydantic reads os.environ itself (environ not given)."""
    for key, value in SERVICE_LINKS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("CALMQ_API_HOST", "0.0.0.0")
    s = Settings.load()
    assert (s.api_host, s.api_port) == ("0.0.0.0", 8080)


def test_an_explicit_port_is_still_a_setting() -> None:
    """CALMQ_API_PORT=9000 is api_port, and a bad port value is still an error."""
    assert Settings.load(environ={"CALMQ_API_PORT": "9000"}).api_port == 9000
    with pytest.raises(ConfigError):
        Settings.load(environ={"CALMQ_API_PORT": "http://10.0.0.1:8080"})
    with pytest.raises(ConfigError) as info:
        Settings.load(environ={"CALMQ_API_SERVICE_HOSTNAME": "x"})  # not a link shape
    assert info.value.code == "unknown_setting"


def test_metrics_listen_on_every_interface_by_default() -> None:
    """metrics_host defaults to 0.0.0.0 (what a pod needs); it is a setting like the rest."""
    assert Settings.load(environ={}).metrics_host == "0.0.0.0"
    assert Settings.load(environ={"CALMQ_METRICS_HOST": "127.0.0.1"}).metrics_host == "127.0.0.1"


def test_fair_use_limits_are_on_by_default() -> None:
    """The per-key rate limit is on by default (200 a second, burst 1,000) and requests
    without a valid key have a per-address limit (5 a second, burst 20)."""
    settings = Settings()
    assert (settings.api_rate_per_second, settings.api_rate_burst) == (200.0, 1000)
    assert (settings.api_unauthenticated_rate_per_second,
            settings.api_unauthenticated_rate_burst) == (5.0, 20)
