"""The calmq command's flags: settings flags come from the Settings model, options read CALMQ_."""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
from importlib.metadata import version
from pathlib import Path

import pytest

import calmq
from calmq.cli import main, parser
from calmq.settings import ENV_PREFIX, Settings


def _commands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _flags(command: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in command._actions if a.option_strings and a.dest != "help"]


def test_version_prints_the_package_version(capsys: pytest.CaptureFixture[str]) -> None:
    """`calmq --version` prints `calmq <version>`: the metadata's, which is calmq.__version__."""
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"calmq {version('calmq')}"
    assert version("calmq") == calmq.__version__


def test_a_setting_flag_is_named_and_typed_by_its_field() -> None:
    """Every flag whose dest is a Settings field is --<field>, typed by the field's annotation."""
    seen = set()
    for name, command in _commands().items():
        for action in _flags(command):
            if action.dest not in Settings.model_fields:
                continue
            seen.add(action.dest)
            assert action.option_strings[0] == "--" + action.dest.replace("_", "-"), name
            assert f"{ENV_PREFIX}{action.dest.upper()}" in (action.help or ""), name
            assert Settings.model_fields[action.dest].description, f"describe {action.dest}"
    assert {"concurrency", "pool", "relay_mode", "api_port", "keda_pools"} <= seen
    args = parser().parse_args(["worker", "--concurrency", "8", "--step-timeout-seconds", "2.5"])
    assert (args.concurrency, args.step_timeout_seconds) == (8, 2.5)
    assert parser().parse_args(["relay", "--mode", "polling"]).relay_mode == "polling"


@pytest.mark.parametrize(
    "argv", [["worker", "--concurrency", "many"], ["relay", "--relay-mode", "kafka"]]
)
def test_a_setting_flag_rejects_what_its_field_would(argv: list[str]) -> None:
    """A value the field's type or choices refuse is a usage error (exit 2)."""
    with pytest.raises(SystemExit) as info:
        parser().parse_args(argv)
    assert info.value.code == 2


def test_options_read_their_calmq_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """An option that is no setting takes CALMQ_<OPTION> as its default; the flag wins."""
    monkeypatch.setenv("CALMQ_DATA_DIR", "/srv/calmq")
    monkeypatch.setenv("CALMQ_JSON", "true")
    monkeypatch.setenv("CALMQ_LIMIT", "7")
    args = parser().parse_args(["dlq", "list"])
    assert (args.data_dir, args.json, args.limit) == ("/srv/calmq", True, 7)
    assert parser().parse_args(["dlq", "list", "--limit", "3"]).limit == 3


def test_every_option_variable_is_known_to_the_parser() -> None:
    """Each option's CALMQ_ variable is in the parser's list of non-setting variables."""
    known = parser().parse_args(["reaper"]).option_env
    for name, command in _commands().items():
        for action in _flags(command):
            if action.dest in Settings.model_fields or action.dest == "drop_slot":
                continue
            assert f"{ENV_PREFIX}{action.dest.upper()}" in known, (name, action.dest)


def _render(tmp_path: Path, *flags: str) -> int:
    return main(["keda", "render", "--output-dir", str(tmp_path), *flags])


def test_setting_flag_wins_over_its_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--keda-pools` beats CALMQ_KEDA_POOLS, which beats the default; both reach Settings."""
    monkeypatch.setenv("CALMQ_KEDA_POOLS", "ocr")
    assert _render(tmp_path / "env") == 0
    assert sorted(p.name for p in (tmp_path / "env").glob("60-worker-*.yaml")) == [
        "60-worker-ocr-deployment.yaml", "60-worker-ocr-scaledobject.yaml"]
    assert _render(tmp_path / "flag", "--keda-pools", "gpu") == 0
    assert {p.name.split("-")[2] for p in (tmp_path / "flag").glob("60-worker-*.yaml")} == {
        "gpu"}


def test_option_variables_are_not_unknown_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CALMQ_API_KEY, CALMQ_JSON and the like are options' variables, not misspelt settings."""
    for name in ("CALMQ_API_KEY", "CALMQ_JSON", "CALMQ_DATA_DIR", "CALMQ_PORT"):
        monkeypatch.setenv(name, "1" if name != "CALMQ_DATA_DIR" else str(tmp_path / "stack"))
    assert _render(tmp_path / "out") == 0


def test_unknown_variable_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A CALMQ_ variable that is neither a setting nor an option fails the command, named."""
    monkeypatch.setenv("CALMQ_CONCURENCY", "8")
    assert _render(tmp_path) == 1
    err = capsys.readouterr().err
    assert "unknown_setting" in err
    assert "CALMQ_CONCURENCY" in err


def _arguments(command: argparse.ArgumentParser) -> list[argparse.Action]:
    """Every flag and positional argument of a command, except argparse's own --help."""
    return [a for a in command._actions if a.dest != "help"]


def test_every_flag_and_argument_of_every_command_has_help() -> None:
    """`calmq X --help` describes each flag and positional: a non-empty text that says more
    than its CALMQ_ variable (a setting flag's help comes from its Settings field)."""
    undescribed = []
    for name, command in _commands().items():
        for action in _arguments(command):
            text = (action.help or "").split("[CALMQ_")[0].strip()
            if not text or text == "None":
                undescribed.append(f"calmq {name} {'/'.join(action.option_strings) or action.dest}")
    assert undescribed == []


@pytest.mark.parametrize("name", ["lag", "budget", "health", "tenants", "dev", "topics", "schemas"])
def test_commands_that_print_data_take_one_output_option(name: str) -> None:
    """The on-call and deployment commands take -o table|json|jsonl, table by default."""
    command = _commands()[name]
    output = next(a for a in command._actions if a.dest == "output")
    assert output.option_strings == ["-o", "--output"]
    assert output.choices == ["table", "json", "jsonl"]
    assert command.get_default("output_default") == "table"


@pytest.mark.parametrize(("name", "needs"), [
    ("lag", ("kafka_bootstrap",)), ("budget", ("database_url",)),
    ("tenants", ("database_url",)), ("dlq", ("database_url",)), ("reaper", ("database_url",)),
    ("health", ()),
])
def test_commands_ask_only_for_the_parts_they_use(name: str, needs: tuple[str, ...]) -> None:
    """Database-only commands do not need Kafka; health reports every part itself."""
    assert _commands()[name].get_default("needs") == needs


def _complete(script: str, *words: str) -> list[str]:
    """What bash offers for the last of ``words`` (the command line so far) with the script:
    the function the script registers for calmq, called as bash would call it."""
    import re
    import subprocess

    function = re.search(r"complete .*-F (\S+) calmq", script)
    assert function, "the script registers no completion function for calmq"
    line = " ".join(f"'{w}'" for w in ("calmq", *words))
    probe = (f"{script}\nCOMP_WORDS=({line}); COMP_CWORD={len(words)}; "
             f"COMP_LINE={line!r}; COMP_POINT=${{#COMP_LINE}}; "
             f"{function.group(1)} calmq '{words[-1]}' '{('calmq', *words)[-2]}'; "
             'printf "%s\\n" "${COMPREPLY[@]}"')
    done = subprocess.run(["bash", "--norc", "--noprofile", "-c", probe], capture_output=True,
                          text=True, timeout=10, check=True)
    return [w.strip() for w in done.stdout.split()]


def test_bash_completion_offers_commands_nested_commands_flags_and_choices(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`calmq completion bash` completes a command, a nested command (jobs rerun), their
    flags, a flag's choices and a positional's choices; zsh gets its own script of them."""
    assert main(["completion", "bash"]) == 0
    script = capsys.readouterr().out
    assert _complete(script, "la") == ["lag"]
    assert _complete(script, "lag", "--po") == ["--pools"]
    assert _complete(script, "budget", "-o", "") == ["table", "json", "jsonl"]
    assert _complete(script, "tenants", "l") == ["list"]
    assert _complete(script, "jobs", "re") == ["rerun"]
    assert "--from-step" in _complete(script, "jobs", "rerun", "--fr")
    assert _complete(script, "provider", "unp") == ["unpause"]
    assert set(_commands()) <= set(_complete(script, ""))
    assert main(["completion", "zsh"]) == 0
    zsh = capsys.readouterr().out
    assert zsh.startswith("#compdef calmq")
    assert "rerun" in zsh


@pytest.mark.skipif(shutil.which("fish") is None and os.environ.get("CI") != "true",
                    reason="fish is not installed (make fish installs it)")
def test_fish_completion_offers_nested_commands_flags_and_choices(
        capsys: pytest.CaptureFixture[str]) -> None:
    """`calmq completion fish`, sourced in fish: commands, nested commands and their flags,
    a flag's choices and a positional's choices, as `complete -C` lists them."""
    import subprocess

    assert main(["completion", "fish"]) == 0
    script = capsys.readouterr().out

    def offered(line: str) -> list[str]:
        done = subprocess.run(
            ["fish", "--no-config", "-c", f"{script}\ncomplete -C {shlex.quote(line)}"],
            capture_output=True, text=True, timeout=20, check=True)
        return [row.split("\t")[0] for row in done.stdout.splitlines()]

    assert offered("calmq la") == ["lag"]
    assert set(offered("calmq jobs ")) >= {"list", "show", "events", "cancel", "rerun"}
    assert "--from-step" in offered("calmq jobs rerun --fr")
    assert "--from-step" not in offered("calmq jobs list --fr")  # flags of their own command
    assert offered("calmq budget -o ") == ["json", "jsonl", "table"]
    assert offered("calmq tenants l") == ["list"]


def test_help_lists_every_command_once_by_section(capsys: pytest.CaptureFixture[str]) -> None:
    """`calmq --help` lists each command once under a section heading, and no module
    docstring meant for developers."""
    with pytest.raises(SystemExit):
        main(["--help"])
    text = capsys.readouterr().out
    assert "work with jobs:" in text
    assert "with ``register``" not in text  # the module docstring, a note to developers
    listed = [line.split()[0] for line in text.splitlines()
              if line.startswith("  ") and not line.startswith("   ")
              and not line.strip().startswith(("-", "COMMAND"))]
    assert sorted(listed) == sorted(_commands())


def test_output_reads_its_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    """CALMQ_OUTPUT sets -o for every command; the flag wins; a wrong value is a usage error."""
    from calmq.cli.output import output_format
    from calmq.errors import UsageError

    monkeypatch.setenv("CALMQ_OUTPUT", "jsonl")
    assert output_format(parser().parse_args(["health"])) == "jsonl"
    assert output_format(parser().parse_args(["health", "-o", "table"])) == "table"
    monkeypatch.setenv("CALMQ_OUTPUT", "yaml")
    with pytest.raises(UsageError):
        output_format(parser().parse_args(["health"]))


def test_submit_refuses_1e999_in_its_input_before_calling_the_api(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`calmq submit --input` with 1e999 (which Python reads as infinity) is a usage error
    naming non_finite_number; nothing is sent (the API URL points nowhere)."""
    monkeypatch.setenv("CALMQ_API_URL", "http://127.0.0.1:9")
    code = main(["submit", "--api-key", "k", "--input", '{"text": "x", "n": 1e999}'])
    assert code == 2
    assert "non_finite_number" in capsys.readouterr().err
