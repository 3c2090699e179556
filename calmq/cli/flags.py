"""The commands' flags and the settings they resolve to.

A flag is either a setting or a command's own option. A setting's flag is made from its
Settings field (name, type, help), and its CALMQ_ variable is read once, by Settings.load.
An option (--json, --data-dir, --api-key, ...) reads its CALMQ_ variable itself, and the
parser keeps the names of those variables so that Settings.load does not take one of them
for a misspelt setting.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from types import UnionType
from typing import TYPE_CHECKING, Any, Literal, Protocol, Union, get_args, get_origin

from calmq.errors import ConfigError, UsageError

if TYPE_CHECKING:
    from calmq.settings import Settings

__all__ = ["Command", "Flags", "Handler", "configure_logging", "data_dir", "json_object",
           "key_values", "settings_for"]

# The locations a running local stack (`calmq dev up`) fills in when they are empty.
STACK_KEYS = ("database_url", "kafka_bootstrap", "schema_registry_url", "object_store_url",
              "api_url", "fake_provider_url")
# And how to reach them, when the stack is a production-shaped one (`calmq dev up --secure`,
# `--brokers 3`, `--pgbouncer`), unless the caller gave the locations: then these are too.
STACK_SECURITY_KEYS = (
    "kafka_security_protocol", "kafka_sasl_mechanism", "kafka_sasl_username",
    "kafka_sasl_password", "kafka_ssl_ca_location", "schema_registry_username",
    "schema_registry_password", "schema_registry_ca_location", "topic_replication",
    "topic_min_insync_replicas", "database_pooler", "direct_database_url",
    "relay_database_url")

_TRUE = ("1", "true", "yes")

Handler = Callable[[argparse.Namespace], int]


class Command(Protocol):
    """Adds one subcommand: ``needs`` names the settings it cannot run without."""

    def __call__(self, name: str, fn: Handler, help_: str, *,
                 needs: Sequence[str] = ...) -> argparse.ArgumentParser: ...


def _option_env(dest: str) -> str:
    from calmq.settings import ENV_PREFIX

    return ENV_PREFIX + dest.upper()


def _field_kind(name: str) -> dict[str, Any]:
    """The argparse type, choices or action of a Settings field, from its annotation."""
    from calmq.settings import Settings

    kind: Any = Settings.model_fields[name].annotation
    if get_origin(kind) in (Union, UnionType):  # an optional value: float | None
        kind = next(a for a in get_args(kind) if a is not type(None))
    if get_origin(kind) is Literal:
        return {"choices": list(get_args(kind))}
    if kind is bool:
        return {"action": argparse.BooleanOptionalAction}
    if kind in (int, float):
        return {"type": kind}
    return {}  # strings, and what pydantic parses from a string (durations, JSON, secrets)


class Flags:
    """Adds the commands' flags; remembers which CALMQ_ variables are options, not settings."""

    def __init__(self) -> None:
        self.option_env: set[str] = set()

    def setting(self, p: argparse.ArgumentParser, name: str, *aliases: str) -> None:
        """``--<name>`` for the Settings field ``name``: typed and described by the field."""
        from calmq.settings import ENV_PREFIX, Settings

        field = Settings.model_fields[name]
        default = "" if field.default in (None, "") else f"; default {field.default}"
        p.add_argument(
            "--" + name.replace("_", "-"), *aliases, dest=name, default=None,
            help=f"{field.description} [{ENV_PREFIX}{name.upper()}{default}]",
            **_field_kind(name),
        )

    def option(self, p: argparse.ArgumentParser, flag: str, *aliases: str,
               **kw: Any) -> None:
        """A command's own flag, which reads CALMQ_<DEST> (the flag wins over it)."""
        from calmq.settings import Settings

        action = p.add_argument(flag, *aliases, **kw)
        if action.dest in Settings.model_fields:
            raise ValueError(f"--{action.dest} is a setting: add it with Flags.setting")
        env = _option_env(action.dest)
        action.help = f"{action.help or ''} [{env}]".lstrip()
        self.option_env.add(env)
        # --yes is never taken from the environment (calmq.cli.bulk refuses CALMQ_YES): a
        # variable left in a shell or a CI job would confirm every bulk action after it.
        if env not in os.environ or action.dest == "yes":
            return
        if kw.get("action") == "store_true":
            action.default = os.environ[env].lower() in _TRUE
        else:
            # argparse converts a string default with the flag's type, as if it were given.
            action.default = os.environ[env]


def json_object(text: str, flag: str = "--input") -> dict[str, Any]:
    """A flag's JSON object, with finite numbers (1e999, which Python reads as infinity, is
    refused here as the API would refuse it)."""
    from calmq.storable import NonFiniteNumber, loads

    try:
        data = loads(text)
    except NonFiniteNumber as exc:
        raise UsageError(f"{flag}: {exc}", code="non_finite_number") from None
    except ValueError as exc:
        raise UsageError(f"{flag} is not JSON: {exc}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise UsageError(f"{flag} is a JSON object", code="invalid_json")
    return data


def key_values(pairs: list[str] | str | None, flag: str = "--metadata") -> dict[str, str] | None:
    """``--metadata KEY=VALUE`` (repeated; one pair from its CALMQ_ variable) as an object;
    None when there is none."""
    if isinstance(pairs, str):
        pairs = [pairs]
    found: dict[str, str] = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise UsageError(f"{flag} {pair!r} is KEY=VALUE", code="invalid_metadata")
        found[key] = value
    return found or None


def settings_environ(args: argparse.Namespace) -> dict[str, str]:
    """The environment without the options' CALMQ_ variables, which are no settings."""
    return {k: v for k, v in os.environ.items() if k not in args.option_env}


def data_dir(args: argparse.Namespace) -> Path:
    from calmq.tooling.devstack import default_data_dir

    return Path(args.data_dir) if getattr(args, "data_dir", None) else default_data_dir()


def settings_for(args: argparse.Namespace, **overrides: Any) -> Settings:
    """Settings from flags, env and the context in use (``calmq context``), with empty
    locations filled from the running local stack.

    Fails with ``no_stack`` when a location the command needs (``args.needs``) is still
    empty: a database-only command asks for the database, not for Kafka.
    """
    from calmq.settings import Settings
    from calmq.tooling.devstack import Stack

    flags = {k: v for k, v in vars(args).items() if k in Settings.model_fields and v is not None}
    flags.update({k: v for k, v in overrides.items() if v is not None})
    # Then the context in use (calmq context use NAME), below flags and CALMQ_ variables and
    # above the local stack: a shell with nothing set acts on the deployment it names.
    from calmq.cli.contexts import active

    context = active()
    for key, value in (context[1] if context else {}).items():
        env_key = "CALMQ_" + key.upper()
        if key not in flags and env_key not in os.environ and env_key + "_FILE" not in os.environ:
            flags[key] = value
    state = Stack(data_dir(args)).state()
    if state is not None:
        filled = set()
        for key in STACK_KEYS:
            env_key = "CALMQ_" + key.upper()
            if not flags.get(key) and not os.environ.get(env_key) and state.env.get(env_key):
                flags[key] = state.env[env_key]
                filled.add(key)
        if {"database_url", "kafka_bootstrap", "schema_registry_url"} & filled:
            for key in STACK_SECURITY_KEYS:
                env_key = "CALMQ_" + key.upper()
                if flags.get(key) or env_key in os.environ or env_key + "_FILE" in os.environ:
                    continue
                if env_key in state.env:
                    flags[key] = state.env[env_key]
                elif env_key + "_FILE" in state.env:
                    flags[key] = Path(state.env[env_key + "_FILE"]).read_text()
    settings = Settings.load(flags, environ=settings_environ(args))
    # One process, one environment: every topic and group it names carries the prefix.
    from calmq import topics

    topics.configure(settings.name_prefix)
    missing = [k for k in getattr(args, "needs", ()) if not getattr(settings, k)]
    if missing:
        raise ConfigError(
            f"{', '.join('CALMQ_' + m.upper() for m in missing)} not set and no local stack is "
            "running: start one with `calmq dev up`, or `eval $(calmq dev env)`",
            code="no_stack",
        )
    return settings


def configure_logging(level: str = "INFO", redact: str = "*") -> None:
    from calmq.logs import configure

    configure(level, redact)  # one JSON object per line (docs/how-to/observability.md)
    # One line per schema-registry HTTP call is noise at INFO.
    logging.getLogger("httpx2").setLevel(logging.WARNING)
    logging.getLogger("httpx").setLevel(logging.WARNING)
