"""The reference docs name every setting and every CLI command the code has."""

from __future__ import annotations

from pathlib import Path

from calmq.cli import parser
from calmq.settings import Settings

DOCS = Path(__file__).resolve().parents[2] / "docs" / "reference"


def test_every_setting_is_documented() -> None:
    """docs/reference/settings.md has a row for each Settings field."""
    text = (DOCS / "settings.md").read_text()
    missing = [n for n in Settings.model_fields if f"`CALMQ_{n.upper()}`" not in text]
    assert missing == []


def test_every_cli_command_is_documented() -> None:
    """docs/reference/cli.md mentions each `calmq` subcommand."""
    text = (DOCS / "cli.md").read_text()
    commands = next(a for a in parser()._actions if a.dest == "command").choices
    missing = [c for c in commands if f"calmq {c}" not in text]
    assert missing == []
