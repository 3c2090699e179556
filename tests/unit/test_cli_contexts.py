"""Named contexts (calmq.cli.contexts): add, use, switch, and where a command's settings come
from: flags, then CALMQ_ variables, then the context in use, then the local stack."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from calmq.cli import main, parser
from calmq.cli.flags import settings_for

PROD = "postgresql://calmq:s3cret@db.prod.internal:5432/calmq"
STAGING = "postgresql://calmq:other@db.staging.internal:5432/calmq"


@pytest.fixture
def config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty config folder and no stack, CALMQ_ variables or context of the caller's."""
    for name in ("CALMQ_CONTEXT", "CALMQ_DATABASE_URL", "CALMQ_KAFKA_BOOTSTRAP"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("CALMQ_DATA_DIR", str(tmp_path / "no-stack"))
    return tmp_path / "config" / "calmq" / "contexts.json"


def _database(*argv: str) -> str:
    return settings_for(parser().parse_args(["jobs", "list", *argv])).database_url


def test_contexts_switch_and_each_command_reads_the_one_in_use(
        config: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The first context added is in use; `use` switches; CALMQ_CONTEXT picks another for one
    shell; a CALMQ_ variable and a flag still win over the context."""
    assert main(["context", "add", "prod", f"database_url={PROD}",
                 "CALMQ_KAFKA_BOOTSTRAP=kafka.prod.internal:9092"]) == 0
    assert main(["context", "add", "staging", f"database_url={STAGING}"]) == 0
    assert _database() == PROD  # the first one added is current
    assert main(["context", "use", "staging"]) == 0
    assert _database() == STAGING
    monkeypatch.setenv("CALMQ_CONTEXT", "prod")
    assert _database() == PROD
    settings = settings_for(parser().parse_args(["jobs", "list"]))
    assert settings.kafka_bootstrap == "kafka.prod.internal:9092"
    monkeypatch.setenv("CALMQ_DATABASE_URL", "postgresql://localhost/override")
    assert _database() == "postgresql://localhost/override"
    monkeypatch.delenv("CALMQ_DATABASE_URL")
    # A setting's flag wins too (worker --concurrency: no command has a --database-url).
    monkeypatch.setenv("CALMQ_CONTEXT", "staging")
    assert main(["context", "add", "load", f"database_url={STAGING}", "kafka_bootstrap=k:9092",
                 "concurrency=7"]) == 0
    monkeypatch.setenv("CALMQ_CONTEXT", "load")
    assert settings_for(parser().parse_args(["worker"])).concurrency == 7
    assert settings_for(parser().parse_args(["worker", "--concurrency", "3"])).concurrency == 3
    capsys.readouterr()
    assert main(["context", "list", "-o", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["name"], r["current"]) for r in rows] == [
        ("load", False), ("prod", False), ("staging", True)]


def test_the_contexts_file_is_the_users_alone_and_show_hides_secrets(
        config: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The file holds database URLs with passwords: mode 0600; `show` prints no password."""
    assert main(["context", "add", "prod", f"database_url={PROD}"]) == 0
    assert stat.S_IMODE(config.stat().st_mode) == 0o600
    capsys.readouterr()
    assert main(["context", "show", "-o", "json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["name"] == "prod"
    assert shown["database_url"] == "***"
    assert "s3cret" not in json.dumps(shown)


def test_unknown_contexts_and_settings_are_refused_with_their_codes(
        config: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A misspelt setting, an invalid value, a second add of a name, `use` of no context and
    a CALMQ_CONTEXT naming none are each an error with a code; nothing falls back silently."""
    assert main(["context", "add", "prod", "databse_url=x"]) == 2
    assert "[unknown_setting]" in capsys.readouterr().err
    assert main(["context", "add", "prod", "api_port=eighty"]) == 2
    assert "[invalid_context_setting]" in capsys.readouterr().err
    assert not config.exists()  # nothing refused was written
    assert main(["context", "add", "prod", f"database_url={PROD}"]) == 0
    assert main(["context", "add", "prod", f"database_url={STAGING}"]) == 2
    assert "[context_exists]" in capsys.readouterr().err
    assert _database() == PROD
    assert main(["context", "use", "nope"]) == 1
    assert "[unknown_context]" in capsys.readouterr().err
    monkeypatch.setenv("CALMQ_CONTEXT", "nope")
    assert main(["jobs", "list"]) == 1
    assert "CALMQ_CONTEXT=nope names no context" in capsys.readouterr().err
