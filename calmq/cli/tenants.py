"""Tenants and their API keys."""

from __future__ import annotations

import argparse
import asyncio

from calmq.cli.flags import Command, Flags, settings_for

__all__ = ["register"]


def cmd_tenants(args: argparse.Namespace) -> int:
    from calmq.data import Store

    settings = settings_for(args)

    async def create() -> str:
        store = Store(settings.database_url, max_size=1)
        await store.open()
        try:
            tenant, key = await store.tenants.create(args.name)
        finally:
            await store.close()
        print(f"tenant {tenant.name} created with id {tenant.id}; its API key (shown once):")
        return key

    if args.action != "create":
        from calmq.data import tenants

        if args.action == "add-key":
            print(f"a new API key for {args.name} (shown once):")
            print(tenants.add_key(settings.database_url, args.name))
        elif args.action == "revoke-key":
            revoked = tenants.revoke_keys(settings.database_url, args.name, args.key_prefix)
            print(f"revoked {len(revoked)} key(s) of {args.name}: {' '.join(revoked)}")
            return 0 if revoked else 1
        else:
            print(tenants.webhook_secret(settings.database_url, args.name))
        return 0
    print(asyncio.run(create()))
    return 0


def register(command: Command, flags: Flags) -> None:
    p = command("tenants", cmd_tenants, "manage tenants", needs=("database_url",))
    p.add_argument("action", choices=["create", "add-key", "revoke-key", "webhook-secret"],
                   help="what to do with the tenant")
    p.add_argument("name", help="the tenant's name")
    flags.option(p, "--key-prefix", help="revoke-key: only the key starting so (12 chars)")
