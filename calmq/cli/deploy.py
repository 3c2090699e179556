"""What a deployment sets up: topics, schemas, Kubernetes and KEDA manifests."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from calmq.cli.flags import Command, Flags, settings_environ, settings_for
from calmq.cli.output import add_output, emit_rows, output_format
from calmq.cli.probes import check_database, check_registry, open_admin
from calmq.errors import ConfigError

if TYPE_CHECKING:
    from calmq.settings import Settings as SettingsType

__all__ = ["create_results_topics", "register"]


def create_results_topics(settings: SettingsType, results_topics: list[str]) -> list[str]:
    """Create tenants' own results topics and their dead-letter twins, as calmq's others
    are made; returns the ones created now."""
    from calmq import topics
    from calmq.kafka import connection_config, create_topics

    names = [n for t in results_topics for n in (t, topics.dead_letter_topic(t))]
    return create_topics(connection_config(settings), names,
                         partitions=settings.topic_partitions,
                         replication=settings.topic_replication,
                         min_insync_replicas=settings.topic_min_insync_replicas,
                         max_message_bytes=settings.kafka_max_message_bytes)


def _tenants_topics(settings: SettingsType) -> tuple[list[str], dict[str, str]]:
    """Every tenant's own results topic, each tenant without one given
    calmq.results.<name> (returned apart: its row is written once the topic exists, as an
    event for a missing topic would go to calmq.dlq instead)."""
    from calmq import topics
    from calmq.data import tenants

    found = tenants.results_topics(settings.database_url)
    fresh = {name: topics.tenant_results_topic(name) for name, topic in found.items()
             if not topic and name != tenants.PLATFORM_TENANT}
    own = {topic for topic in found.values() if topic}
    return sorted(own | set(fresh.values())), fresh


def cmd_topics(args: argparse.Namespace) -> int:
    from calmq import topics
    from calmq.kafka import connection_config, create_topics

    settings = settings_for(args)
    connection = connection_config(settings)
    open_admin(connection)  # fail in seconds, with the address, not in 15 s
    names = topics.all_topics([settings.pool], [t for t, _ in settings.retry_tier_list])
    fresh: dict[str, str] = {}
    # With results per tenant, every tenant's own topics too (they live in the database:
    # only then is it read, so a deployment's Kafka setup needs no database otherwise).
    if settings.results_topic_per_tenant:
        if not settings.database_url:
            raise ConfigError("results_topic_per_tenant: `calmq topics create` reads the "
                              "tenants from the database; set CALMQ_DATABASE_URL",
                              code="no_stack")
        check_database(settings)
        own, fresh = _tenants_topics(settings)
        names += [n for t in own for n in (t, topics.dead_letter_topic(t))]
    created = create_topics(connection, names,
                            partitions=settings.topic_partitions,
                            replication=settings.topic_replication,
                            min_insync_replicas=settings.topic_min_insync_replicas,
                            max_message_bytes=settings.kafka_max_message_bytes)
    if fresh:
        from calmq.data import tenants

        for name, topic in fresh.items():
            tenants.set_results_topic(settings.database_url, name, topic)
    rows = [{"topic": name, "created": name in created} for name in names]
    if output_format(args) != "table":
        emit_rows(rows, output_format(args), [])
        return 0
    for name in names:
        print(f"{'created' if name in created else 'exists '} {name}")
    return 0


def cmd_schemas(args: argparse.Namespace) -> int:
    from calmq.codec import RegistryCodec, SchemaStore, registry_config

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
    check_registry(settings)
    ids = RegistryCodec(settings.schema_registry_url, config=registry_config(settings),
                        subject_prefix=settings.name_prefix).register_all()
    if output_format(args) != "table":
        emit_rows([{"event_type": e, "schema_id": i} for e, i in ids.items()],
                  output_format(args), [])
        return 0
    for event_type, schema_id in ids.items():
        print(f"{event_type}: schema id {schema_id}")
    return 0


def _render_settings(args: argparse.Namespace) -> SettingsType:
    """The settings a render computes its defaults from: a settings file, then CALMQ_
    variables, then flags. Not settings_for(): a running local stack's 127.0.0.1
    addresses must not leak into manifests for a cluster."""
    from calmq.tooling.kubernetes import load_settings

    path = getattr(args, "settings", None)
    flags = {"concurrency": args.concurrency, "keda_pools": args.keda_pools,
             "keda_namespace": args.keda_namespace}
    return load_settings(Path(path) if path else None, settings_environ(args), flags)


def cmd_keda(args: argparse.Namespace) -> int:
    # Replaced by `calmq k8s render --only workers`, which it runs: the worker Deployments
    # and their ScaledObjects, and never a ConfigMap of its own (one without the provider
    # settings, applied after the full render, turned every model call into a failure).
    print("calmq keda render is replaced by `calmq k8s render --only workers`; running that",
          file=sys.stderr)
    args.only = "workers"
    args.values = ""
    args.output_dir = args.output_dir or "deploy/keda"
    return cmd_k8s(args)


def cmd_k8s(args: argparse.Namespace) -> int:
    from calmq.tooling.kubernetes import default_values, dump_all, render, values_for, write

    settings = _render_settings(args)
    namespace = settings.keda_namespace
    if args.action == "values":
        from calmq.settings import Settings
        from calmq.tooling.chart import values_text
        from calmq.tooling.keda import pools

        values = default_values(settings)
        # helm -f merges over the chart's values: a pool of the chart's (the default
        # settings', read from no environment) that these settings lack is removed by name.
        for name in pools(Settings.model_construct()):
            values["workers"]["pools"].setdefault(name, None)
        print(values_text(values, "calmq chart values, computed by `calmq k8s values` from "
                          "the settings (for helm -f)"), end="")
        return 0
    files = [f.strip() for f in (args.values or "").split(",") if f.strip()]
    values = values_for(settings, *(Path(f) for f in files))
    if args.action == "chart":
        from calmq.tooling.chart import write_chart

        for path in write_chart(values, Path(args.output_dir or "deploy/helm/calmq")):
            print(f"wrote {path}")
        return 0
    if args.output_dir == "-":
        sys.stdout.write(dump_all(render(values, namespace, only=args.only),
                                  "calmq k8s render"))
        return 0
    for path in write(values, Path(args.output_dir or "deploy/kubernetes"), namespace,
                      only=args.only):
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
    p = command("keda", cmd_keda, "replaced by `calmq k8s render --only workers`")
    p.add_argument("action", choices=["render"], help="run `calmq k8s render --only workers`")
    option(p, "--output-dir", help="where to write (default deploy/keda)")
    setting(p, "concurrency")
    setting(p, "keda_pools")
    setting(p, "keda_namespace", "--namespace")
    p = command("k8s", cmd_k8s, "render Kubernetes manifests, the chart's values, or the chart")
    p.add_argument("action", choices=["render", "values", "chart"],
                   help="render: the manifests and the Kustomize base; values: the chart "
                        "values these settings give; chart: write the Helm chart")
    option(p, "--values", "-f", help="chart values file(s), as `helm -f` takes them (a comma "
                                   "list: later ones win)")
    option(p, "--settings", help="YAML file of settings (setting: value) the defaults are "
                                 "computed from, before CALMQ_ variables and flags")
    option(p, "--output-dir", "-o", help="where to write (default deploy/kubernetes; "
                                         "chart: deploy/helm/calmq); - : one YAML stream "
                                         "to stdout")
    option(p, "--only", choices=["workers"],
           help="workers: only the worker Deployments and their ScaledObjects")
    setting(p, "concurrency")
    setting(p, "keda_pools")
    setting(p, "keda_namespace", "--namespace")
