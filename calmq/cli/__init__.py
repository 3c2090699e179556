"""The ``calmq`` command. Every flag also reads ``CALMQ_<FLAG>`` from the environment.

Settings that are empty (database, Kafka, registry, object store, API, fake provider) are
taken from the running local stack (`calmq dev up`), so a command started by hand joins it.

One module per group of commands; each adds its subcommands with ``register``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from calmq.cli import (
    batches,
    completion,
    contract,
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
           batches, providers, contract)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("calmq")
    except PackageNotFoundError:  # run from a checkout that was never installed
        from calmq import __version__

        return __version__


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="calmq", description=__doc__)
    root.add_argument("--version", action="version", version=f"calmq {_version()}")
    sub = root.add_subparsers(dest="command", required=True)
    flags = Flags()

    def command(name: str, fn: Handler, help_: str, *,
                needs: Sequence[str] = ()) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        p.set_defaults(fn=fn, needs=tuple(needs))
        flags.option(p, "--data-dir",
                     help="the local stack's folder (default: a per-user temp dir)")
        return p

    for group in _GROUPS:
        group.register(command, flags)
    root.set_defaults(option_env=frozenset({*flags.option_env, OUTPUT_ENV}))
    return root


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
