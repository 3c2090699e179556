"""What a deployment sets up: topics, schemas, Kubernetes and KEDA manifests."""

from __future__ import annotations

import argparse
from pathlib import Path

from calmq.cli.flags import Command, Flags, settings_environ, settings_for
from calmq.cli.output import add_output, emit_rows, output_format
from calmq.cli.probes import check_registry, open_admin
from calmq.errors import ConfigError

__all__ = ["register"]


def cmd_topics(args: argparse.Namespace) -> int:
    from calmq import topics
    from calmq.kafka import create_topics

    settings = settings_for(args)
    open_admin(settings.kafka_bootstrap)  # fail in seconds, with the address, not in 15 s
    names = topics.all_topics([settings.pool], [t for t, _ in settings.retry_tier_list])
    created = create_topics(settings.kafka_bootstrap, names,
                            partitions=settings.topic_partitions,
                            replication=settings.topic_replication,
                            max_message_bytes=settings.kafka_max_message_bytes)
    rows = [{"topic": name, "created": name in created} for name in names]
    if output_format(args) != "table":
        emit_rows(rows, output_format(args), [])
        return 0
    for name in names:
        print(f"{'created' if name in created else 'exists '} {name}")
    return 0


def cmd_schemas(args: argparse.Namespace) -> int:
    from calmq.codec import RegistryCodec, SchemaStore

    if args.action == "check":
        from calmq.tooling.schemas_check import check_backward, check_forward

        problems = check_backward(SchemaStore()) + check_forward(SchemaStore())
        for p in problems:
            print(p)
        print("every schema version reads the one before it and the one after it"
              if not problems else f"{len(problems)} compatibility problem(s)")
        return 1 if problems else 0
    settings = settings_for(args)
    if not settings.schema_registry_url:
        raise ConfigError("no schema registry: set CALMQ_SCHEMA_REGISTRY_URL",
                          code="no_schema_registry")
    check_registry(settings.schema_registry_url)
    ids = RegistryCodec(settings.schema_registry_url).register_all()
    if output_format(args) != "table":
        emit_rows([{"event_type": e, "schema_id": i} for e, i in ids.items()],
                  output_format(args), [])
        return 0
    for event_type, schema_id in ids.items():
        print(f"{event_type}: schema id {schema_id}")
    return 0


def cmd_keda(args: argparse.Namespace) -> int:
    from calmq.settings import Settings
    from calmq.tooling.keda import write

    # Not _settings(): a running local stack's 127.0.0.1 addresses must not leak into
    # manifests for a cluster. Empty addresses render as the in-cluster service names.
    flags = {"concurrency": args.concurrency, "keda_pools": args.keda_pools}
    settings = Settings.load(flags, environ=settings_environ(args))
    for path in write(settings, Path(args.output_dir or "deploy/keda")):
        print(f"wrote {path}")
    return 0


def cmd_k8s(args: argparse.Namespace) -> int:
    from calmq.tooling.kubernetes import load_values, write

    # As `keda render`: no local stack's addresses. The values file is the one source of
    # the settings; CALMQ_ variables and flags win over it.
    values = Path(args.values) if args.values else None
    flags = {"concurrency": args.concurrency, "keda_pools": args.keda_pools}
    settings = load_values(values, settings_environ(args), flags)
    for path in write(settings, Path(args.output_dir or "deploy/kubernetes")):
        print(f"wrote {path}")
    return 0


def register(command: Command, flags: Flags) -> None:
    setting, option = flags.setting, flags.option
    p = command("topics", cmd_topics, "create calmq's topics", needs=("kafka_bootstrap",))
    p.add_argument("action", choices=["create"], help="create the missing topics")
    setting(p, "pool")
    add_output(p)
    p = command("schemas", cmd_schemas, "register or check the Avro schemas")
    p.add_argument("action", choices=["register", "check"],
                   help="register with the registry, or check each version reads the last")
    add_output(p)
    p = command("keda", cmd_keda, "render KEDA manifests")
    p.add_argument("action", choices=["render"], help="write the manifests")
    option(p, "--output-dir", help="where to write (default deploy/keda)")
    setting(p, "concurrency")
    setting(p, "keda_pools")
    p = command("k8s", cmd_k8s, "render Kubernetes manifests for every part")
    p.add_argument("action", choices=["render"], help="write the manifests")
    option(p, "--values", help="YAML file of settings (setting: value) to render from")
    option(p, "--output-dir", help="where to write (default deploy/kubernetes)")
    setting(p, "concurrency")
    setting(p, "keda_pools")
