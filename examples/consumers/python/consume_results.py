"""A downstream consumer of calmq.results: confluent-kafka and its registry AvroDeserializer.

Prints one JSON line per job result and exits after --max-messages results or --idle-timeout
seconds without one. Every flag also reads an environment variable (see --help). The
defaults reach the Docker Compose stack from its host (docker-compose.kafka.yml); for
`calmq dev up`, `eval $(calmq dev env)` first.

    pip install "confluent-kafka[avro,schemaregistry]"
    python consume_results.py --api-key "$CALMQ_API_KEY" --max-messages 10

A secured cluster: --config FILE, a properties file (key=value lines, # comments) of
librdkafka consumer properties (security.protocol, sasl.mechanism, sasl.username,
sasl.password, ssl.ca.location, ...) and of the registry client's, prefixed
schema.registry. (schema.registry.basic.auth.user.info=USER:PASSWORD,
schema.registry.ssl.ca.location=CA.pem).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import urllib.request

from confluent_kafka import Consumer
from confluent_kafka.schema_registry import SchemaRegistryClient
from confluent_kafka.schema_registry.avro import AvroDeserializer
from confluent_kafka.serialization import MessageField, SerializationContext

REGISTRY_PREFIX = "schema.registry."


def parse_args() -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bootstrap", default=env("CALMQ_KAFKA_BOOTSTRAP", "localhost:29092"))
    p.add_argument("--registry",
                   default=env("CALMQ_SCHEMA_REGISTRY_URL",
                               "http://localhost:8081/apis/ccompat/v7"),
                   help="the registry's Confluent-compatible API")
    p.add_argument("--api", default=env("CALMQ_API_URL", "http://localhost:8080"))
    p.add_argument("--topic", default=env("CALMQ_RESULTS_TOPIC", "calmq.results"),
                   help="calmq.results, or a tenant's own (calmq.results.<tenant>)")
    p.add_argument("--config", default=env("CALMQ_CONSUMER_CONFIG"),
                   help="a properties file for a secured cluster and registry")
    p.add_argument("--api-key", default=env("CALMQ_API_KEY"))
    p.add_argument("--group", default=env("CALMQ_CONSUMER_GROUP", "results-example-python"))
    p.add_argument("--tenant-id", default=env("CALMQ_TENANT_ID"),
                   help="print only this tenant's results (the others are skipped, committed)")
    p.add_argument("--max-messages", type=int, default=int(env("CALMQ_MAX_MESSAGES", "0")),
                   help="exit after this many results (0: no limit)")
    p.add_argument("--idle-timeout", type=float, default=float(env("CALMQ_IDLE_TIMEOUT", "30")),
                   help="exit after this many seconds without a message")
    return p.parse_args()


def fetch_artifact(api: str, key: str, job_id: str) -> bytes:
    """The artifact's bytes through the API: its URI (file://, s3://) names calmq's storage."""
    if not api.startswith(("http://", "https://")):
        raise SystemExit(f"--api must be an http(s) URL, not {api!r}")
    req = urllib.request.Request(f"{api}/v1/jobs/{job_id}/artifact",  # noqa: S310 - checked
                                 headers={"Authorization": f"Bearer {key}"})
    with urllib.request.urlopen(req, timeout=30) as resp:  # noqa: S310 - http(s) only
        return resp.read()


def read_properties(path: str | None) -> dict[str, str]:
    """A .properties file's key=value pairs (blank lines and # or ! comments skipped)."""
    found: dict[str, str] = {}
    if path is None:
        return found
    with open(path, encoding="utf-8") as f:
        for raw in f:
            line = raw.strip()
            if line and not line.startswith(("#", "!")):
                key, _, value = line.partition("=")
                found[key.strip()] = value.strip()
    return found


def main() -> int:
    args = parse_args()
    config = read_properties(args.config)
    # schema.registry.<key> goes to the registry client as <key>; the rest to the consumer.
    registry = {k[len(REGISTRY_PREFIX):]: v for k, v in config.items()
                if k.startswith(REGISTRY_PREFIX)}
    deserialize = AvroDeserializer(SchemaRegistryClient({"url": args.registry, **registry}))
    last_message = time.monotonic()
    consumer = Consumer({
        "bootstrap.servers": args.bootstrap,
        **{k: v for k, v in config.items() if not k.startswith(REGISTRY_PREFIX)},
        "group.id": args.group,
        "auto.offset.reset": "earliest",  # a new group starts at the oldest retained result
        "enable.auto.commit": False,  # commit after processing: at-least-once delivery
    })
    # The idle clock starts once partitions are assigned: joining the group takes seconds of
    # its own (more on a loaded machine), and must not count as idle.
    assigned = False

    def on_assign(_consumer: Consumer, _partitions: list) -> None:
        nonlocal assigned, last_message
        assigned, last_message = True, time.monotonic()

    consumer.subscribe([args.topic], on_assign=on_assign)
    # Redelivery (a restart before a commit, a producer retry) repeats an event with the same
    # `id` header. An in-memory set is enough for an example; a real service keeps the ids it
    # has processed in its own database, in the transaction that applies the result.
    seen: set[str] = set()
    printed = 0
    try:
        while not args.max_messages or printed < args.max_messages:
            msg = consumer.poll(1.0)
            if msg is None:
                if assigned and time.monotonic() - last_message > args.idle_timeout:
                    break
                continue
            if msg.error():
                raise SystemExit(f"kafka: {msg.error()}")
            last_message = time.monotonic()
            headers = {k: v.decode() for k, v in msg.headers() or []}
            event_id = headers["id"]
            # Messages of one partition arrive in order and a job's events share its key (the
            # job id), so they share a partition: process one partition's messages one at a
            # time and a job's later result always comes after its earlier ones.
            if headers.get("eventType") == "job.result" and event_id not in seen:
                result = deserialize(msg.value(), SerializationContext(msg.topic(),
                                                                       MessageField.VALUE))
                if args.tenant_id in (None, str(result["tenant_id"])):
                    print(json.dumps(handle(args, result, event_id)), flush=True)
                    printed += 1
                seen.add(event_id)
            consumer.commit(message=msg, asynchronous=False)
    finally:
        consumer.close()  # leaves the group at once, so its partitions move without a wait
    return 0


def handle(args: argparse.Namespace, result: dict, event_id: str) -> dict:
    """What a service does with one result; here, the line this example prints."""
    sha256 = None
    if result["artifact"] is not None:
        body = fetch_artifact(args.api, args.api_key, str(result["job_id"]))
        sha256 = hashlib.sha256(body).hexdigest()
        if sha256 != result["artifact"]["sha256"]:
            raise SystemExit(f"artifact of {result['job_id']} does not match its digest")
    # v2 fields: absent from v1 events, which the deserializer returns as written (no key).
    metadata = result.get("metadata")
    return {
        "job_id": str(result["job_id"]),
        "status": result["status"],
        "artifact_sha256": sha256,
        "error_code": result["error"]["code"] if result["error"] else None,
        "metadata": json.loads(metadata) if metadata is not None else None,
        "event_id": event_id,
        "workflow_version": result.get("workflow_version"),
        "usage": result.get("usage"),
    }


if __name__ == "__main__":
    sys.exit(main())
