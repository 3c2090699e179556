"""Named contexts: ``calmq context use prod`` points every later command at one deployment.

As ``kubectl config use-context`` and ``temporal env`` do: a context is a name for a set of
settings (the database, the Kafka cluster, the registry, the API), kept in one file under
the user's config folder, and one of them is current. ``CALMQ_CONTEXT`` picks another for one
shell or one command. A command's settings come from, in order: its flags, the ``CALMQ_``
variables, the context, and last the local stack (``calmq dev up``); so a shell that has no
variables set acts on the context it names, and a bulk action's confirmation says which.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path
from typing import Any

from calmq.cli.flags import Command, Flags
from calmq.cli.output import Exit, add_output, emit_one, emit_rows, output_format
from calmq.errors import ConfigError, UsageError

__all__ = ["CONTEXT_ENV", "active", "register"]

CONTEXT_ENV = "CALMQ_CONTEXT"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def _path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME")
    if not base:
        try:
            base = str(Path.home() / ".config")
        except (RuntimeError, KeyError):  # no home at all (a pod's user with no passwd entry)
            base = os.path.join(os.sep, "nonexistent", ".config")
    return Path(base) / "calmq" / "contexts.json"


def _read() -> dict[str, Any]:
    path = _path()
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        return {"current": None, "contexts": {}}
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{path} cannot be read as calmq's contexts ({exc}); fix or remove "
                          "it", code="invalid_contexts_file") from exc
    if not isinstance(doc, dict) or not isinstance(doc.get("contexts"), dict):
        raise ConfigError(f"{path} is not calmq's contexts file (no \"contexts\" object); "
                          "fix or remove it", code="invalid_contexts_file")
    return doc


def _write(doc: dict[str, Any]) -> Path:
    path = _path()
    path.parent.mkdir(parents=True, exist_ok=True)
    # Contexts hold database URLs with their passwords: readable by the user alone, as
    # kubectl's kubeconfig is. Written beside and renamed, so a failed write loses nothing.
    tmp = path.with_suffix(".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump(doc, out, indent=2, sort_keys=True)
        out.write("\n")
    tmp.replace(path)
    return path


def active() -> tuple[str, dict[str, str]] | None:
    """The context in use (``CALMQ_CONTEXT``, else the current one) and its settings; None
    when there is none. A ``CALMQ_CONTEXT`` naming no context is an error, not a silent
    fall back to the local stack."""
    chosen = os.environ.get(CONTEXT_ENV) or None
    if chosen is None and not _path().exists():
        return None
    doc = _read()
    name = chosen or doc.get("current")
    if not name:
        return None
    settings = doc["contexts"].get(name)
    if settings is None:
        where = f"{CONTEXT_ENV}={name}" if chosen else f"the current context {name!r}"
        raise ConfigError(f"{where} names no context in {_path()}: `calmq context list` shows "
                          "them", code="unknown_context")
    return name, dict(settings)


def _check_name(name: str) -> str:
    if not _NAME.match(name):
        raise UsageError(f"{name!r} is no context name: letters, digits, '.', '_' and '-'",
                         code="invalid_context_name")
    return name


def _assignments(pairs: list[str]) -> dict[str, str]:
    """``database_url=...`` pairs, each naming a setting (CALMQ_ spelling accepted)."""
    from calmq.settings import ENV_PREFIX, Settings

    values: dict[str, str] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        key = key.strip().removeprefix(ENV_PREFIX).lower()
        if not sep or not key:
            raise UsageError(f"{pair!r}: give SETTING=VALUE, e.g. "
                             "database_url=postgresql://...", code="invalid_context_setting")
        if key not in Settings.model_fields:
            raise UsageError(f"{pair.partition('=')[0]}: no setting of that name "
                             "(docs/reference/settings.md lists them)",
                             code="unknown_setting")
        values[key] = value
    # What the context would give a command is checked now, not at the first command.
    try:
        Settings.load(values, environ={})
    except ConfigError as exc:
        raise UsageError(f"the context's settings are not valid: {exc.message}",
                         code="invalid_context_setting") from exc
    return values


def cmd_context(args: argparse.Namespace) -> int:
    fmt = output_format(args)
    doc = _read()
    contexts: dict[str, dict[str, str]] = doc["contexts"]
    action = args.context_action
    if action == "list":
        rows = [{"name": n, "current": n == doc.get("current"),
                 "settings": sorted(contexts[n])} for n in sorted(contexts)]
        if fmt == "table":
            for n in sorted(contexts):
                mark = "*" if n == doc.get("current") else " "
                print(f"{mark} {n}  {', '.join(sorted(contexts[n]))}")
            if not rows:
                print("no contexts: `calmq context add NAME database_url=...`")
            return Exit.OK
        emit_rows(rows, fmt, [])
        return Exit.OK
    if action == "show":
        found = active() if args.name is None else (
            (args.name, contexts[args.name]) if args.name in contexts else None)
        if found is None:
            raise ConfigError("no context in use" if args.name is None
                              else f"no context named {args.name!r}", code="unknown_context")
        name, values = found
        from calmq.settings import Settings

        secret = {n for n, f in Settings.model_fields.items()
                  if "Secret" in str(f.annotation)} | {"database_url", "direct_database_url",
                                                        "relay_database_url"}
        shown = {k: ("***" if k in secret else v) for k, v in sorted(values.items())}
        emit_one({"name": name, **shown}, fmt)
        return Exit.OK
    name = _check_name(args.name or "")
    if action != "add" and (args.settings or args.replace):
        raise UsageError("SETTING=VALUE and --replace go with add", code="usage")
    if action == "add":
        if name in contexts and not args.replace:
            raise UsageError(f"context {name!r} exists: --replace to overwrite it",
                             code="context_exists")
        contexts[name] = _assignments(args.settings)
        if doc.get("current") is None:
            doc["current"] = name
        path = _write(doc)
        print(f"context {name} saved in {path}"
              + (" and in use" if doc["current"] == name else ""))
    elif action == "use":
        if name not in contexts:
            raise ConfigError(f"no context named {name!r}: `calmq context list` shows them",
                              code="unknown_context")
        doc["current"] = name
        _write(doc)
        print(f"now using context {name}")
    elif action == "remove":
        if contexts.pop(name, None) is None:
            raise ConfigError(f"no context named {name!r}", code="unknown_context")
        if doc.get("current") == name:
            doc["current"] = None
        _write(doc)
        print(f"context {name} removed")
    return Exit.OK


def register(command: Command, flags: Flags) -> None:
    p = command("context", cmd_context,
                "named sets of settings (a deployment each): list, show, add, use, remove")
    p.add_argument("context_action", metavar="ACTION",
                   choices=["list", "show", "add", "use", "remove"],
                   help="list the contexts, show one (secrets hidden), add one, use one from "
                        "now on, remove one")
    p.add_argument("name", nargs="?", help="the context's name (show: default the one in use)")
    p.add_argument("settings", nargs="*", metavar="SETTING=VALUE",
                   help="add: the context's settings, e.g. database_url=postgresql://... "
                        "kafka_bootstrap=host:9092 (CALMQ_ spellings too)")
    flags.option(p, "--replace", action="store_true",
                 help="add: overwrite an existing context")
    add_output(p)
