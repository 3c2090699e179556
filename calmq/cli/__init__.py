"""The ``calmq`` command: one module per group of commands, each adding its subcommands with
``register``; ``parser`` lists them by group in ``calmq --help`` (``_SECTIONS``).

Settings that are empty (database, Kafka, registry, object store, API, fake provider) are
taken from the running local stack (`calmq dev up`), so a command started by hand joins it.
"""

from __future__ import annotations

import argparse
import sys
import textwrap
from collections.abc import Generator, Sequence

from calmq.cli import (
    batches,
    completion,
    contexts,
    contract,
    costs,
    database,
    deadletters,
    deploy,
    dev,
    jobs,
    operations,
    providers,
    services,
    tenants,
)
from calmq.cli.flags import Flags, Handler
from calmq.cli.output import OUTPUT_ENV, Exit
from calmq.errors import CalmqError, UsageError

__all__ = ["main", "parser"]

_GROUPS = (dev, services, database, tenants, jobs, deadletters, operations, deploy, completion,
           batches, providers, contract, contexts, costs)
# calmq --help: what a person reaches for first comes first. A group module's commands go to
# its section; a module missing here fails the parser's test (tests/unit/test_cli.py).
_SECTIONS: dict[str, tuple[object, ...]] = {
    "work with jobs": (jobs, deadletters, batches),
    "operate a deployment": (contexts, tenants, providers, operations, costs),
    "run the parts (one process each)": (services, database),
    "deploy": (deploy, contract),
    "try it on this machine": (dev,),
    "shell": (completion,),
}
_DESCRIPTION = """\
calmq runs slow, flaky, paid AI calls as jobs: an API accepts them, PostgreSQL and Kafka carry
them, workers call the model with retries, budgets and fair share. Every flag also reads
CALMQ_<FLAG> from the environment; settings left empty are taken from the local stack that
`calmq dev up` started. `calmq COMMAND --help` describes a command."""


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("calmq")
    except PackageNotFoundError:  # run from a checkout that was never installed
        from calmq import __version__

        return __version__


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="calmq", description=_DESCRIPTION,
                                   formatter_class=_SectionedHelp)
    root.add_argument("--version", action="version", version=f"calmq {_version()}")
    sub = root.add_subparsers(dest="command", required=True, metavar="COMMAND",
                              help="one of the commands below, by section")
    flags = Flags()
    listed: dict[object, list[tuple[str, str]]] = {}
    group: object = None

    def command(name: str, fn: Handler, help_: str, *,
                needs: Sequence[str] = ()) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(fn=fn, needs=tuple(needs))
        flags.option(p, "--data-dir",
                     help="the local stack's folder (default: a per-user temp dir)")
        listed.setdefault(group, []).append((name, help_))
        return p

    for group in _GROUPS:
        group.register(command, flags)
    root.epilog = _sections(listed)
    root.set_defaults(option_env=frozenset({*flags.option_env, OUTPUT_ENV}))
    return root


class _SectionedHelp(argparse.RawDescriptionHelpFormatter):
    """calmq --help: the commands are listed by section in the epilog, so not again in one
    flat block under the COMMAND argument (their help stays on the parser: shell completion
    reads it there)."""

    def _iter_indented_subactions(self, action: argparse.Action
                                  ) -> Generator[argparse.Action, None, None]:
        if isinstance(action, argparse._SubParsersAction):
            return
        yield from super()._iter_indented_subactions(action)


def _sections(listed: dict[object, list[tuple[str, str]]]) -> str:
    rows = [(title, [c for m in modules for c in listed.get(m, [])])
            for title, modules in _SECTIONS.items()]
    width = max(len(name) for _, commands in rows for name, _ in commands)
    lines = []
    for title, commands in rows:
        lines.append(f"{title}:")
        lines += [textwrap.fill(help_, 100, initial_indent=f"  {name.ljust(width)}  ",
                                subsequent_indent=" " * (width + 4))
                  for name, help_ in commands]
        lines.append("")
    return "\n".join(lines).rstrip()


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        code: int = args.fn(args)
        return code
    except CalmqError as exc:
        print(f"calmq: error [{exc.code}]: {exc.message}", file=sys.stderr)
        return Exit.USAGE if isinstance(exc, UsageError) else Exit.ERROR
    except KeyboardInterrupt:
        return 130
    except OSError as exc:
        # A network or file failure no command turned into a CalmqError of its own (an API
        # that does not answer, a folder that cannot be written): still one line, no
        # traceback. Bugs are not OSErrors, so they keep theirs.
        print(f"calmq: error [os_error]: {exc}; `calmq health` checks every address",
              file=sys.stderr)
        return Exit.ERROR
