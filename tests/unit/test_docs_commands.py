"""The docs' commands and settings are the code's: every `calmq` command in a fenced shell block
parses with calmq's own parser, and every `CALMQ_` variable the docs name is a setting, a
command's option, or one of the few variables that are documented as neither. These are
the two checks a reader can make by script; the rest of a page is read by people."""

from __future__ import annotations

import contextlib
import io
import re
import shlex
from collections.abc import Iterator
from pathlib import Path

import pytest

from calmq import settings as settings_module
from calmq.cli import parser
from calmq.settings import ENV_PREFIX, Settings

ROOT = Path(__file__).resolve().parents[2]
PAGES = [*sorted((ROOT / "docs").rglob("*.md")), ROOT / "README.md"]
_SHELLS = ("", "sh", "bash", "shell", "console")
# A command line in a block: optional VAR=value assignments, then calmq (or .venv/bin/calmq).
_COMMAND = re.compile(r"^(?:\$ )?(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:[\w./-]*/)?calmq\s+(\w.*)$")
# Named in the docs and no setting: the service links Kubernetes injects (the page explains
# why calmq ignores them), the chaos suite's seed, and a variable of the reader's own code.
_NOT_SETTINGS = {"CALMQ_API_SERVICE_HOST", "CALMQ_API_PORT_8080_TCP", "CALMQ_CHAOS_SEED",
                 "CALMQ_WEBHOOK_SECRET"}


def _blocks(text: str) -> Iterator[tuple[int, str]]:
    """(line number, line) of every line inside a fenced block in a shell's language."""
    fence: str | None = None
    language = ""
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if fence is None:
            if stripped.startswith(("```", "~~~")):
                fence, language = stripped[:3], stripped[3:].strip().split(" ")[0]
            continue
        if stripped.startswith(fence):
            fence = None
            continue
        if language in _SHELLS:
            yield number, line


def _commands() -> Iterator[tuple[str, str]]:
    for page in PAGES:
        lines = list(_blocks(page.read_text()))
        i = 0
        while i < len(lines):
            number, line = lines[i]
            while line.endswith("\\") and i + 1 < len(lines):  # a command continued
                i += 1
                line = line[:-1] + " " + lines[i][1].strip()
            i += 1
            match = _COMMAND.match(line.strip())
            if not match:
                continue
            command = re.split(r"\s+(?:#|\||>|&&|;|2>)", match.group(1))[0].strip()
            command = command.removesuffix("&").strip()  # started in the background
            # A synopsis (`calmq lag [--pools P] [-o table|json]`) is a pattern, not a command.
            if re.search(r"\[|\||\.\.\.|…|\{", command):
                continue
            yield f"{page.relative_to(ROOT)}:{number}", command


COMMANDS = list(_commands())


def test_the_docs_have_commands_to_check() -> None:
    """The block reader finds the docs' commands (so the check below checks something)."""
    assert len(COMMANDS) > 100
    assert any(c.startswith("dev up") for _, c in COMMANDS)


@pytest.mark.parametrize(("where", "command"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_each_documented_command_parses(where: str, command: str) -> None:
    """A `calmq` command in the docs' shell blocks is one the parser accepts as written."""
    argv = [re.sub(r"^<[^>]+>$", "x", a) for a in shlex.split(command)]
    err = io.StringIO()
    code: str | int | None = 0
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser().parse_args(argv)
    except SystemExit as exc:  # argparse's way to refuse (or to print --help: code 0)
        code = exc.code
    assert code == 0, f"{where}: calmq {command}\n{err.getvalue().strip()}"


def test_each_documented_variable_exists() -> None:
    """Each CALMQ_ variable a page names is a setting (or its _FILE), a command's option,
    an old name still read, or one of the few documented as no setting."""
    known = {ENV_PREFIX + name.upper() for name in Settings.model_fields}
    known |= set(parser().get_default("option_env"))
    known |= set(settings_module._NON_SETTING_ENV) | set(settings_module._ALIASES)
    known |= _NOT_SETTINGS
    unknown = set()
    for page in PAGES:
        text = page.read_text()
        for match in re.finditer(r"\bCALMQ_[A-Z0-9_]*[A-Z0-9](_\*)?", text):
            if match.group(1):  # CALMQ_SPEND_CAP_*: a family, named by its prefix
                prefix = match.group(0)[:-1]
                if not any(k.startswith(prefix) for k in known):
                    unknown.add((page.name, match.group(0)))
                continue
            name = match.group(0).removesuffix("_FILE")
            if name not in known:
                unknown.add((page.name, name))
    assert sorted(unknown) == []
