"""Tenants and their API keys."""

from __future__ import annotations

import argparse
import asyncio
import sys
from dataclasses import asdict
from typing import TYPE_CHECKING, Any, TextIO

from calmq.cli.connect import open_store
from calmq.cli.flags import Command, Flags, settings_for
from calmq.cli.output import Exit, add_output, emit_one, emit_rows, output_format
from calmq.cli.probes import check_database
from calmq.errors import UsageError

if TYPE_CHECKING:
    from calmq.settings import Settings

__all__ = ["register"]

# Every key acts for its tenant ("role": "tenant", as before); "roles" says what it may do
# there (a key made before migration 0013, or without --roles, has all of them) and
# "platform" whether the console shows it every tenant. Operator commands use the database.
_KEY_ROLE = "tenant"


def _list(args: argparse.Namespace) -> int:
    from calmq.data.tenants import ROLES

    settings = settings_for(args)

    async def read() -> list[Any]:
        async with open_store(settings, max_size=1) as store:
            return await store.tenants.with_keys(args.name)

    tenants = asyncio.run(read())
    rows: list[dict[str, Any]] = []
    for t in tenants:
        keys = [{**k, "role": _KEY_ROLE, "roles": k.get("roles") or list(ROLES),
                 "platform": bool(k.get("platform")), "active": k["revoked_at"] is None}
                for k in t.keys]
        # ISO times, as the API writes them and as the keys' times come from PostgreSQL.
        last = t.last_job_at.isoformat() if t.last_job_at else None
        rows.append({**asdict(t), "created_at": t.created_at.isoformat(), "last_job_at": last,
                     "keys": keys,
                     "active_keys": [k["prefix"] for k in keys if k["active"]],
                     "revoked_keys": [k["prefix"] for k in keys if not k["active"]],
                     "last_used_at": last})
    fmt = output_format(args)
    if fmt == "table":
        table = [{**r, "active_keys": " ".join(r["active_keys"]) or "none",
                  "revoked": len(r["revoked_keys"])} for r in rows]
        emit_rows(table, fmt, ["name", "id", "created_at", "last_used_at", "weight",
                               "active_keys", "revoked"], empty="no tenants")
    else:
        emit_rows(rows, fmt, [])
    if args.name and not rows:
        return Exit.ERROR
    return Exit.OK


def _amount(text: str | None, flag: str, kind: type[float] | type[int]) -> float | None:
    """A limit as given: a number >= 0, or "none" for no limit of the tenant's own."""
    if text is None or text.strip().lower() in ("none", "default"):
        return None
    try:
        value = kind(text)
    except ValueError:
        raise UsageError(f"{flag} is a number >= 0 or none, not {text!r}") from None
    if value < 0:
        raise UsageError(f"{flag} is a number >= 0 or none, not {text!r}")
    return value


def _limits(args: argparse.Namespace) -> int:
    """set-quota and set-spend-cap: the tenant row's own limits (migration 0012)."""
    from calmq.data.spending import SpendLedger

    settings = settings_for(args)
    if args.action == "set-quota":
        if args.tokens_per_minute is None:
            raise UsageError("usage: calmq tenants set-quota NAME --tokens-per-minute N|default")
        tokens = _amount(args.tokens_per_minute, "--tokens-per-minute", int)
    else:
        if args.daily_usd is None and args.monthly_usd is None:
            raise UsageError("usage: calmq tenants set-spend-cap NAME [--daily-usd X|none] "
                             "[--monthly-usd X|none]")
        daily = _amount(args.daily_usd, "--daily-usd", float)
        monthly = _amount(args.monthly_usd, "--monthly-usd", float)

    async def write() -> bool:
        async with open_store(settings, max_size=1) as store:
            ledger = SpendLedger(store)
            if args.action == "set-quota":
                return await ledger.set_quota(args.name, None if tokens is None
                                              else int(tokens))
            return await ledger.set_cap(
                args.name, daily=False if args.daily_usd is None else daily,
                monthly=False if args.monthly_usd is None else monthly)

    check_database(settings)
    if not asyncio.run(write()):
        print(f"no tenant named {args.name}", file=sys.stderr)
        return Exit.ERROR
    if args.action == "set-quota":
        what = ("the default fair share" if tokens is None
                else "no quota of its own" if tokens == 0 else f"{int(tokens)} tokens/minute")
        print(f"token quota of {args.name}: {what}")
    else:
        given = [f"{window} {value if value is not None else 'none'}"
                 for window, flag, value in (("daily", args.daily_usd, daily),
                                             ("monthly", args.monthly_usd, monthly))
                 if flag is not None]
        print(f"spend caps of {args.name} (USD): {', '.join(given)}; waiting work resumes "
              "within spend_cap_refresh_seconds of a raise")
    return Exit.OK


def _set_weight(args: argparse.Namespace) -> int:
    """set-weight: the tenant's weight in every lane's fair share (migration 0044)."""
    from calmq.data.fairness import FairQueue

    usage = "usage: calmq tenants set-weight NAME --weight W (a number > 0, at most 1000)"
    if args.weight is None:
        raise UsageError(usage)
    try:
        weight = float(args.weight)
    except ValueError:
        raise UsageError(f"--weight is a number > 0, at most 1000, not {args.weight!r}"
                         ) from None
    if not 0 < weight <= 1000:  # also NaN; the column's CHECK says the same
        raise UsageError(f"--weight is a number > 0, at most 1000, not {args.weight!r}")
    settings = settings_for(args)

    async def write() -> bool:
        async with open_store(settings, max_size=1) as store:
            return await FairQueue(store).set_weight(args.name, weight)

    check_database(settings)
    if not asyncio.run(write()):
        print(f"no tenant named {args.name}", file=sys.stderr)
        return Exit.ERROR
    print(f"weight of {args.name}: {weight:g} (its share of a contended lane's slots, against "
          "the other busy tenants' weights; workers with fair_share on use it at their next "
          "pick)")
    return Exit.OK


def own_results_topic(settings: Settings, name: str, topic: str | None) -> str:
    """Give the tenant ``name`` its own results topic (``topic``, or calmq.results.<name>):
    the topic and its .dlq twin are created first, then the tenant's row names it, so no
    event goes to a topic that does not exist yet."""
    from calmq import topics
    from calmq.cli.deploy import create_results_topics
    from calmq.data import tenants

    chosen = topics.check_results_topic(topic) if topic else topics.tenant_results_topic(name)
    create_results_topics(settings, [chosen])
    tenants.set_results_topic(settings.database_url, name, chosen)
    return chosen


def _results_topic(args: argparse.Namespace) -> int:
    """results-topic: where the tenant's results and dead letters go (migration 0056)."""
    from calmq import topics
    from calmq.data import tenants

    if args.topic and args.shared:
        raise UsageError("--topic or --shared, not both")
    settings = settings_for(args)
    check_database(settings)
    if args.shared:
        tenants.set_results_topic(settings.database_url, args.name, None)
        print(f"results of {args.name} go to the shared {topics.RESULTS} from its next event "
              f"(dead letters to {topics.DLQ})")
        return Exit.OK
    chosen = own_results_topic(settings, args.name, args.topic)
    print(chosen)
    print(f"results of {args.name} go to {chosen}, its dead letters to "
          f"{topics.dead_letter_topic(chosen)}, from its next event; grant its consumer "
          "READ on that topic alone (docs/how-to/consume-results.md)", file=sys.stderr)
    return Exit.OK


def cmd_tenants(args: argparse.Namespace) -> int:
    if args.action == "list":
        return _list(args)
    if args.roles is not None and args.action not in ("add-key", "platform-key"):
        raise UsageError("--roles goes with add-key or platform-key")
    if args.action == "platform-key":
        from calmq.data import tenants

        if args.name:
            raise UsageError("usage: calmq tenants platform-key [--roles ROLES]")
        settings = settings_for(args)
        check_database(settings)
        key = tenants.add_key(settings.database_url, tenants.PLATFORM_TENANT,
                              tenants.parse_roles(args.roles), platform=True)
        _shown_once(args, "a platform API key (shown once; the console shows it every tenant):",
                    {"tenant": tenants.PLATFORM_TENANT, "api_key": key})
        return 0
    if not args.name:
        raise UsageError(f"usage: calmq tenants {args.action} NAME")
    if args.action in ("set-quota", "set-spend-cap"):
        return _limits(args)
    if args.action == "set-weight":
        return _set_weight(args)
    if args.action == "results-topic":
        return _results_topic(args)
    if args.topic is not None or args.shared:
        raise UsageError("--topic and --shared go with results-topic")
    if args.weight is not None:
        raise UsageError("--weight goes with set-weight")
    if args.rotate and args.action != "webhook-secret":
        raise UsageError("--rotate goes with webhook-secret")
    settings = settings_for(args)

    async def create() -> None:
        async with open_store(settings, max_size=1) as store:
            tenant, key = await store.tenants.create(args.name)
        created: dict[str, object] = {"tenant": tenant.name, "id": str(tenant.id)}
        if settings.results_topic_per_tenant:
            topic = own_results_topic(settings, tenant.name, None)
            created["results_topic"] = topic
            print(f"its results go to {topic}", file=_human(args))
        _shown_once(args, f"tenant {tenant.name} created with id {tenant.id}; its API key "
                          "(shown once):", {**created, "api_key": key})

    if args.action != "create":
        from calmq.data import tenants

        check_database(settings)  # one error line with the address, not a traceback
        if args.action == "add-key":
            key = tenants.add_key(settings.database_url, args.name,
                                  tenants.parse_roles(args.roles))
            _shown_once(args, f"a new API key for {args.name} (shown once):",
                        {"tenant": args.name, "api_key": key})
        elif args.action == "revoke-key":
            revoked = tenants.revoke_keys(settings.database_url, args.name, args.key_prefix)
            print(f"revoked {len(revoked)} key(s) of {args.name}: {' '.join(revoked)}")
            return 0 if revoked else 1
        elif args.rotate:
            grace = settings.webhook_secret_grace_seconds
            done = tenants.rotate_webhook_secret(settings.database_url, args.name, grace)
            _shown_once(args, None, {"tenant": args.name, "webhook_secret": done.current,
                                     "previous_signs_until": done.previous_until})
            until = (f"until {done.previous_until.isoformat()}" if done.previous_until
                     else "no longer (grace 0)")
            print(f"the previous secret of {args.name} also signs deliveries {until}",
                  file=sys.stderr)
        else:
            _shown_once(args, None, {"tenant": args.name, "webhook_secret":
                                     tenants.webhook_secret(settings.database_url, args.name)})
        return 0
    asyncio.run(create())
    return 0


def _human(args: argparse.Namespace) -> TextIO:
    """Where a sentence for a person goes: stdout in a table, stderr beside JSON."""
    return sys.stdout if output_format(args) == "table" else sys.stderr


def _shown_once(args: argparse.Namespace, intro: str | None, shown: dict[str, Any]) -> None:
    """A new key or secret: in a table the sentence, then the value alone on the last line
    (what scripts have read so far); with ``-o json``/``jsonl`` one object naming it, so a
    script never parses a sentence to find a key."""
    fmt = output_format(args)
    secret = shown.get("api_key", shown.get("webhook_secret"))
    if fmt == "table":
        if intro:
            print(intro)
        print(secret)
        return
    emit_one(shown, fmt)


def register(command: Command, flags: Flags) -> None:
    p = command("tenants", cmd_tenants, "manage tenants: list, create, add-key, revoke-key, "
                "webhook-secret, platform-key, set-quota, set-spend-cap, set-weight, "
                "results-topic",
                needs=("database_url",))
    p.add_argument("action", choices=["list", "create", "add-key", "revoke-key",
                                      "webhook-secret", "platform-key", "set-quota",
                                      "set-spend-cap", "set-weight", "results-topic"],
                   help="list the tenants and their keys, or act on one tenant")
    p.add_argument("name", nargs="?",
                   help="the tenant's name (list: only this tenant; required otherwise)")
    flags.option(p, "--roles", default=None,
                 help="add-key, platform-key: what the key may do, comma-separated: submit, "
                      "review, operate (default: all)")
    flags.option(p, "--key-prefix", help="revoke-key: only the key starting so (12 chars)")
    flags.option(p, "--rotate", action="store_true",
                 help="webhook-secret: make a new secret and print it; the previous one "
                      "also signs deliveries for --webhook-secret-grace-seconds")
    flags.setting(p, "webhook_secret_grace_seconds")
    flags.option(p, "--tokens-per-minute",
                 help="set-quota: the tenant's token quota per minute (0: none of its own; "
                      "default: the fair share of the fleet's)")
    flags.option(p, "--daily-usd",
                 help="set-spend-cap: the tenant's cap per UTC day in USD (none: no cap)")
    flags.option(p, "--monthly-usd",
                 help="set-spend-cap: the tenant's cap per UTC month in USD (none: no cap)")
    flags.option(p, "--weight",
                 help="set-weight: the tenant's weight in a contended lane's fair share "
                      "(default 1; 2 gets twice the slots of a tenant of weight 1)")
    flags.option(p, "--topic", default=None,
                 help="results-topic: the tenant's own results topic (calmq.results.<...>; "
                      "default calmq.results.NAME); its dead letters go to TOPIC.dlq")
    flags.option(p, "--shared", action="store_true",
                 help="results-topic: back to the shared calmq.results")
    flags.setting(p, "results_topic_per_tenant")
    add_output(p)
