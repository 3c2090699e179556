"""Settings: one pydantic model, read from ``CALMQ_*`` environment variables and flags.

Unknown keys are an error, not ignored: a typo in ``CALMQ_CONCURENCY`` would otherwise run
a fleet with the default and nobody would notice. Components receive a ``Settings``
instance in their constructor; nothing reads the environment after start-up.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from calmq import __version__
from calmq.calls.pricing import DEFAULT_PRICES, ModelPrice, tier_price
from calmq.errors import ConfigError
from calmq.jobs import Priority
from calmq.limits import KEEP_ERRORS, MAX_METADATA_BYTES, MAX_NOTE_BYTES

__all__ = [
    "ENV_PREFIX",
    "FILE_SUFFIX",
    "IMAGE_REPOSITORY",
    "PROBLEM_BASE_URL",
    "STRICT_ENV",
    "Settings",
    "claimed_window",
    "kafka_properties",
    "parse_duration",
    "service_links",
]

ENV_PREFIX = "CALMQ_"
# CALMQ_<NAME>_FILE=/path reads a setting from a file: a Kubernetes Secret mounted as a
# volume, or a Docker secret, never shows the value in the pod spec or `ps e`.
FILE_SUFFIX = "_FILE"

# Variables with the prefix that are not settings but are still ours to read: the test
# session's, the strictness switch below, and the names the results-consumer examples
# (examples/consumers/) read, so that a shell set up for them still runs the CLI.
STRICT_ENV = "CALMQ_STRICT_SETTINGS"
_NON_SETTING_ENV = frozenset({"CALMQ_TEST_KEEP_STACK", STRICT_ENV, "CALMQ_CONSUMER_GROUP",
                              "CALMQ_TENANT_ID", "CALMQ_MAX_MESSAGES", "CALMQ_IDLE_TIMEOUT",
                              "CALMQ_RESULTS_TOPIC", "CALMQ_CONSUMER_CONFIG",
                              # the CLI's context in use (calmq.cli.contexts), no setting
                              "CALMQ_CONTEXT"})
# Old names kept for one release: variable -> the setting it now sets (a warning says so).
_ALIASES = {"CALMQ_KEDA_IMAGE": "image"}
# Where the release workflow pushes the image (docs/how-to/deploy-kubernetes.md).
IMAGE_REPOSITORY = "ghcr.io/calmq/calmq"
# The API reference as the repository publishes it: a problem's type URI is this and its code,
# an anchor of docs/reference/api.md (setting api_problem_base_url).
PROBLEM_BASE_URL = "https://github.com/calmq/calmq/blob/main/docs/reference/api.md#"

log = logging.getLogger(__name__)

# Kubernetes injects, for every Service in the namespace (unless the pod sets
# enableServiceLinks: false), Docker-link style variables: a Service named calmq-api gives
# CALMQ_API_SERVICE_HOST, CALMQ_API_SERVICE_PORT[_<name>], CALMQ_API_PORT=tcp://ip:port and
# CALMQ_API_PORT_<port>_<PROTO>[_PROTO|_PORT|_ADDR]. They carry our prefix by accident.
_LINK_NAMES = (
    re.compile(r"^CALMQ_(?:[A-Z0-9_]+_)?SERVICE_(?:HOST|PORT(?:_[A-Z0-9_]+)?)$"),
    re.compile(r"^CALMQ_(?:[A-Z0-9_]+_)?PORT_\d+_(?:TCP|UDP|SCTP)(?:_(?:PROTO|PORT|ADDR))?$"),
)
# ..._PORT itself is shaped by its value: CALMQ_API_PORT=tcp://10.0.0.1:8080 is a link, while
# CALMQ_API_PORT=8080 is the api_port setting.
_LINK_PORT = re.compile(r"^CALMQ_(?:[A-Z0-9_]+_)?PORT$")
_LINK_VALUE = re.compile(r"^(?:tcp|udp|sctp)://[^\s]+:\d+$")
_warned_links = False


def service_links(env: Mapping[str, str]) -> list[str]:
    """The ``CALMQ_`` variables of ``env`` that are Kubernetes service links, not settings."""
    return sorted(
        k for k, v in env.items()
        if any(p.match(k) for p in _LINK_NAMES) or (_LINK_PORT.match(k) and _LINK_VALUE.match(v))
    )


def claimed_window(slots: int) -> int:
    """Jobs a worker holds claimed (in flight, offsets uncommitted) for ``slots`` call slots:
    the slots plus an eighth, so a freed slot starts the next job without waiting for a
    poll. The worker bounds its consumer with it and the KEDA renderer derives
    ``lagThreshold`` from it, so both must read the same function."""
    return slots + max(1, slots // 8)


def parse_duration(text: str) -> float:
    """``"5s"``, ``"2m"``, ``"1h"``, ``"250ms"`` or a plain number of seconds -> seconds."""
    units = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
    text = text.strip()
    for suffix in ("ms", "s", "m", "h"):
        if text.endswith(suffix) and text[: -len(suffix)].replace(".", "", 1).isdigit():
            return float(text[: -len(suffix)]) * units[suffix]
    try:
        return float(text)
    except ValueError:
        raise ConfigError(
            f"cannot read {text!r} as a duration; use a number of seconds or 250ms, 5s, 2m, 1h"
        ) from None


# librdkafka properties that kafka_config may not set: each has a setting of its own (named
# in the error), or calmq's correctness rests on it (commits after durability, idempotent
# acks=all producers, the Java-compatible partitioner, the workers' group names).
_OWN_PROPERTIES = {
    "bootstrap.servers": "CALMQ_KAFKA_BOOTSTRAP",
    "metadata.broker.list": "CALMQ_KAFKA_BOOTSTRAP",
    "security.protocol": "CALMQ_KAFKA_SECURITY_PROTOCOL",
    "sasl.mechanism": "CALMQ_KAFKA_SASL_MECHANISM",
    "sasl.mechanisms": "CALMQ_KAFKA_SASL_MECHANISM",
    "sasl.username": "CALMQ_KAFKA_SASL_USERNAME",
    "sasl.password": "CALMQ_KAFKA_SASL_PASSWORD",
    "sasl.oauthbearer.method": "CALMQ_KAFKA_SASL_OAUTHBEARER_METHOD",
    "sasl.oauthbearer.token.endpoint.url": "CALMQ_KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL",
    "sasl.oauthbearer.client.id": "CALMQ_KAFKA_SASL_OAUTHBEARER_CLIENT_ID",
    "sasl.oauthbearer.client.secret": "CALMQ_KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET",
    "sasl.oauthbearer.scope": "CALMQ_KAFKA_SASL_OAUTHBEARER_SCOPE",
    "sasl.oauthbearer.extensions": "CALMQ_KAFKA_SASL_OAUTHBEARER_EXTENSIONS",
    "ssl.ca.location": "CALMQ_KAFKA_SSL_CA_LOCATION",
    "ssl.certificate.location": "CALMQ_KAFKA_SSL_CERTIFICATE_LOCATION",
    "ssl.key.location": "CALMQ_KAFKA_SSL_KEY_LOCATION",
    "ssl.key.password": "CALMQ_KAFKA_SSL_KEY_PASSWORD",
    "compression.type": "CALMQ_KAFKA_COMPRESSION",
    "compression.codec": "CALMQ_KAFKA_COMPRESSION",
}
_FIXED_PROPERTIES = frozenset({
    "group.id", "enable.auto.commit", "enable.auto.offset.store", "enable.idempotence",
    "acks", "request.required.acks", "partitioner", "isolation.level",
    "partition.assignment.strategy", "transactional.id",
})


def kafka_properties(text: str) -> dict[str, Any]:
    """``CALMQ_KAFKA_CONFIG``: a JSON object, or properties text (``key=value`` lines, ``#``
    comments, as a Java client's .properties file). Raises ValueError (a ConfigError through
    Settings.load) for what cannot be read, and for a property calmq sets itself, naming
    the setting to use instead. Whether each name is a librdkafka property is checked when
    a client configuration is made (calmq.kafka.connection_config), by librdkafka itself."""
    import json

    text = text.strip()
    if not text:
        return {}
    props: dict[str, Any]
    if text.startswith("{"):
        try:
            loaded = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"kafka_config is not a JSON object: {exc}") from None
        if not isinstance(loaded, dict) or not all(
                isinstance(v, str | int | float | bool) for v in loaded.values()):
            raise ValueError("kafka_config must be a JSON object of strings, numbers and"
                             " booleans")
        props = {str(k).strip(): v for k, v in loaded.items()}
    else:
        props = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith(("#", "!")):
                continue
            key, sep, value = line.partition("=")
            if not sep:
                key, sep, value = line.partition(":")
            if not sep or not key.strip():
                raise ValueError(f"kafka_config line {number} is not key=value: {line[:60]!r}")
            props[key.strip()] = value.strip()
    for key in props:
        if key in _OWN_PROPERTIES:
            raise ValueError(f"kafka_config sets {key}: use {_OWN_PROPERTIES[key]} instead")
        if key in _FIXED_PROPERTIES:
            raise ValueError(f"kafka_config sets {key}, which calmq sets itself (its delivery"
                             " guarantees rest on it)")
    return props


# Registry client properties that schema_registry_config may not set: each has a setting of
# its own, which registry_config checks against the others (basic auth or a token, not both).
_OWN_REGISTRY_PROPERTIES = {
    "url": "CALMQ_SCHEMA_REGISTRY_URL",
    "basic.auth.user.info": "CALMQ_SCHEMA_REGISTRY_USERNAME and _PASSWORD",
    "basic.auth.credentials.source": "CALMQ_SCHEMA_REGISTRY_USERNAME and _PASSWORD",
    "ssl.ca.location": "CALMQ_SCHEMA_REGISTRY_CA_LOCATION",
    "ssl.certificate.location": "CALMQ_SCHEMA_REGISTRY_CERTIFICATE_LOCATION",
    "ssl.key.location": "CALMQ_SCHEMA_REGISTRY_KEY_LOCATION",
}


def registry_properties(text: str) -> dict[str, Any]:
    """``CALMQ_SCHEMA_REGISTRY_CONFIG``: the registry client's other properties, read as
    kafka_config is (a JSON object or key=value lines). The registry's OAuth (Confluent
    Cloud's OAUTHBEARER, Azure IMDS) is only these ``bearer.auth.*`` keys, so calmq passes
    them through rather than shadowing each with a setting; the client itself refuses a name
    it does not know when the codec is made."""
    import json

    text = text.strip()
    if not text:
        return {}
    props: dict[str, Any]
    if text.startswith("{"):
        try:
            loaded = json.loads(text)
        except ValueError as exc:
            raise ValueError(f"schema_registry_config is not a JSON object: {exc}") from None
        if not isinstance(loaded, dict) or not all(
                isinstance(v, str | int | float | bool) for v in loaded.values()):
            raise ValueError("schema_registry_config must be a JSON object of strings,"
                             " numbers and booleans")
        props = {str(k).strip(): v for k, v in loaded.items()}
    else:
        props = {}
        for number, raw in enumerate(text.splitlines(), 1):
            line = raw.strip()
            if not line or line.startswith(("#", "!")):
                continue
            key, sep, value = line.partition("=")
            if not sep or not key.strip():
                raise ValueError(f"schema_registry_config line {number} is not key=value:"
                                 f" {line[:60]!r}")
            props[key.strip()] = value.strip()
    for key in props:
        if key in _OWN_REGISTRY_PROPERTIES:
            raise ValueError(f"schema_registry_config sets {key}: use "
                             f"{_OWN_REGISTRY_PROPERTIES[key]} instead")
    return props


class Settings(BaseSettings):
    """Every setting of every component; see docs/reference/settings.md."""

    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="forbid", frozen=True)

    # Where the real parts are. Empty means "the running local stack" (calmq dev env).
    database_url: str = ""
    migrate_database_url: str = Field(
        default="",
        description="the database URL `calmq migrate` uses (a role that may run DDL); "
                    "empty: database_url")
    relay_database_url: str = Field(
        default="",
        description="the database URL the relay uses (a role with REPLICATION); empty: "
                    "database_url")
    database_pooler: Literal["none", "transaction"] = Field(
        default="none",
        description="transaction: database_url is a pooler in transaction mode (PgBouncer"
                    " pool_mode=transaction): no server-side prepared statements, and LISTEN"
                    " and the relay connect directly (direct_database_url,"
                    " relay_database_url)")
    direct_database_url: str = Field(
        default="",
        description="a direct connection, not through a transaction pooler: the API's"
                    " LISTEN session (default: database_url)")
    kafka_bootstrap: str = ""
    schema_registry_url: str = Field(
        default="",
        description="Confluent-compatible registry; empty: Avro single-object encoding",
    )
    object_store_url: str = ""
    artifact_link_seconds: int = Field(
        default=900, ge=1, le=7 * 24 * 3600,
        description="lifetime of the presigned URL GET /v1/jobs/{id} gives for an S3 artifact",
    )
    api_url: str = ""
    fake_provider_url: str = ""

    # Intake API.
    api_host: str = Field(default="127.0.0.1", description="address the API listens on")
    api_port: int = Field(default=8080, ge=0, le=65535, description="port the API listens on")
    api_metrics_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="serve the API's /metrics on this port (on api_host) instead of the API "
                    "port, which then answers 404 there; unset: on the API port")
    api_console: bool = Field(
        default=True, description="serve the web console (/console); false: its routes "
                                  "answer 404")
    api_console_port: int | None = Field(
        default=None, ge=0, le=65535,
        description="serve the console on this port (on api_host) instead of the API port; "
                    "unset: on the API port")
    console_session_seconds: float = Field(
        default=8 * 3600.0, ge=60, le=30 * 24 * 3600,
        description="how long a console sign-in lasts: the session cookie holds a random "
                    "token of its own (stored server-side as a hash, ended by sign-out or "
                    "by revoking its key), never the API key")
    api_problem_base_url: str = Field(
        default=PROBLEM_BASE_URL, pattern=r"^https?://\S+#$",
        description="where a problem's type URI points: this URL (ending in #) followed by "
                    "the problem's code, an anchor of docs/reference/api.md (Problem codes)")
    max_body_bytes: int = Field(default=1024 * 1024, ge=1024)
    auth_cache_seconds: float = Field(default=5.0, ge=0)
    auth_cache_max_misses: int = Field(
        default=1000, ge=0, le=1_000_000,
        description="unknown API keys the API remembers at most (the oldest is forgotten "
                    "first); misses never push a known key out of its cache")
    # Fair use of one API process (calmq.producers.throttle; per process, not fleet-wide).
    # On by default, high enough for one busy client (1,000 submits at once, then 200 a
    # second) and low enough that one key cannot take a whole API process (about 4,000
    # accepts a second: BENCHMARKS.md).
    api_rate_per_second: float = Field(
        default=200.0, ge=0,
        description="requests a second each API key may send (token bucket); past it 429 "
                    "rate_limited with Retry-After; 0: no limit")
    api_rate_burst: int = Field(
        default=1000, ge=1,
        description="the token bucket's size: requests a key may send at once after a pause")
    api_unauthenticated_rate_per_second: float = Field(
        default=5.0, ge=0,
        description="requests a second each client address may send without a valid API "
                    "key (missing, unknown or revoked; token bucket per address); past it "
                    "429 unauthenticated_rate_limited with Retry-After, before the key is "
                    "looked up; 0: no limit")
    api_unauthenticated_rate_burst: int = Field(
        default=20, ge=1,
        description="the per-address bucket's size: requests without a valid key an "
                    "address may send at once")
    api_streams_per_tenant: int = Field(
        default=100, ge=0,
        description="SSE streams (GET /v1/jobs/{id}/events) one tenant may hold open in one "
                    "API process; more answer 429 too_many_streams; 0: no cap")
    api_prefer_wait_max_seconds: float = Field(
        default=30.0, ge=0, le=300,
        description="the longest wait POST /v1/jobs honours from Prefer: wait=N (RFC 7240): "
                    "a job final within it is answered 200 with its result; 0: never waits")
    api_bulk_max_jobs: int = Field(
        default=1000, ge=1, le=10_000,
        description="most jobs one POST /v1/jobs/bulk may carry (all written in one "
                    "transaction); more answers 413 too_many_jobs and writes nothing")
    api_bulk_max_body_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, le=256 * 1024 * 1024,
        description="largest body of POST /v1/jobs/bulk (max_body_bytes bounds every other "
                    "request); more answers 413 body_too_large and writes nothing")
    api_reads_per_tenant: int = Field(
        default=8, ge=0,
        description="expensive reads (job, review and dead-letter lists, artifact "
                    "downloads) one tenant may run at once in one API process; more answer "
                    "429 too_many_reads; 0: no cap")
    max_upload_bytes: int = Field(default=100 * 1024 * 1024, ge=1)
    max_multipart_parts: int = Field(
        default=16, ge=1, le=10_000,
        description="most parts a multipart submit may have (the file and every field); "
                    "more answers 413 too_many_parts and stores nothing")
    max_multipart_field_bytes: int = Field(
        default=1024 * 1024, ge=1024,
        description="largest total size of a multipart submit's non-file fields; more "
                    "answers 413 fields_too_large and stores nothing")
    # Size limits on what a tenant sends that reaches an event or a row, measured as it
    # will encode (docs/explanation/security.md lists every limit and what happens at it).
    max_metadata_bytes: int = Field(
        default=MAX_METADATA_BYTES, ge=2, le=512 * 1024,
        description="largest submit metadata, as the compact ASCII JSON the job.result and "
                    "job.dead_lettered events carry (non-ASCII text counts 6 bytes a "
                    "character); more answers 413 metadata_too_large")
    max_note_bytes: int = Field(
        default=MAX_NOTE_BYTES, ge=16, le=64 * 1024,
        description="largest free-text note (a review's reason and reviewer, a redrive's "
                    "reason and by, a cancel's reason), as UTF-8 JSON text; more answers "
                    "413 note_too_large")
    max_job_errors: int = Field(
        default=KEEP_ERRORS, ge=1, le=1000,
        description="a job keeps the errors of its last this many failed attempts (older "
                    "ones drop off); job.dead_lettered carries them")
    children_per_parent_max: int = Field(
        default=100_000, ge=1, le=1_000_000,
        description="most child jobs one step may start (ctx.spawn); more fails the step "
                    "(input, too_many_children) and starts none")
    children_depth_max: int = Field(
        default=3, ge=1, le=20,
        description="how deep child jobs may nest (a child starting children is level 2); "
                    "a step past it fails (input, children_too_deep) and starts none")
    children_in_flight_max: int = Field(
        default=1000, ge=1, le=1_000_000,
        description="most of one step's child jobs queued or running at once; the rest wait "
                    "(waiting_reason parent_in_flight) and each child that ends releases the "
                    "next, in input order")
    idempotency_retention_seconds: float = Field(default=24 * 3600.0, gt=0)
    job_retention_seconds: float = Field(default=30 * 24 * 3600.0, ge=0)  # 0: keep forever
    history_partition_hours: float = Field(
        default=24.0, ge=1 / 60, le=24 * 31,
        description="width of each time partition of job_events and job_attempts that the "
                    "housekeeping makes from now on (partitions already made keep theirs); "
                    "retention drops a partition whole once every job with history in it is "
                    "past retention")
    history_partitions_ahead: int = Field(
        default=3, ge=1, le=60,
        description="how many partitions of job_events and job_attempts the housekeeping "
                    "keeps made ahead of now (the API's retention sweep and every worker's "
                    "and `calmq reaper`'s housekeeping, each every few minutes): an insert "
                    "finds no partition only after that many partition widths without any "
                    "of them running")
    accept_batch_max: int = Field(default=256, ge=1)
    webhook_dispatcher: bool = True  # deliver callbacks from inside the API process
    webhook_allow_private: bool = False  # let callback_url reach loopback/private addresses
    webhook_timeout_seconds: float = Field(default=10.0, gt=0)
    webhook_connect_timeout_seconds: float = Field(
        default=3.0, gt=0,
        description="time limit of a webhook's TCP (and TLS) connect, within "
                    "webhook_timeout_seconds: an endpoint that drops the connect frees its "
                    "slot after this long")
    webhook_slots_per_tenant: int = Field(
        default=4, ge=1, le=1000,
        description="webhook deliveries one tenant may have in flight at once in one API "
                    "process; its other due deliveries wait, so one tenant's slow or dead "
                    "endpoint holds only its own slots")
    webhook_payload_version: int = Field(
        default=2, ge=1, le=2,
        description="a webhook's body: 2, the Standard Webhooks shape {type: job.<event>, "
                    "timestamp, data: the job}; 1, calmq's first {event, job}, kept for one "
                    "release for receivers not moved yet")
    webhook_max_attempts: int = Field(default=8, ge=1)
    webhook_backoff_seconds: float = Field(default=2.0, gt=0)
    webhook_secret_grace_seconds: float = Field(
        default=24 * 3600.0, ge=0,
        description="after `calmq tenants webhook-secret NAME --rotate`, how long the "
                    "previous secret still signs deliveries beside the new one")

    # Model provider used by the gateway. Empty provider_url means the fake provider.
    provider: Literal["openai", "azure", "anthropic"] = "openai"
    provider_url: str = ""
    provider_api_key: SecretStr = SecretStr("")
    model: str = "fake-small"
    # The providers' endpoints and behaviour (docs/reference/providers.md).
    provider_extra_headers: dict[str, str] = Field(
        default_factory=dict,
        description="headers sent with every provider call, JSON (a LiteLLM proxy's or an "
                    "OpenAI-compatible gateway's own, e.g. {\"X-Team\": \"search\"})")
    provider_api_version: str = Field(
        default="", description="Azure OpenAI deployment URLs: the api-version query "
                                "parameter (the v1 API needs none)")
    structured_outputs: dict[str, Literal["schema", "prompt"]] = Field(
        default_factory=dict,
        description="per model name (fnmatch pattern), JSON: schema sends the output's "
                    "schema (response_format / output_config.format), prompt only asks in "
                    "the prompt; default schema, except Anthropic's claude-3* (prompt)")
    provider_probe_seconds: float = Field(
        default=15.0, gt=0,
        description="while a provider and model are blocked (bad key, permission, model, "
                    "billing), a worker makes one tiny probe call this often; success "
                    "lifts the block")
    provider_retry_after_max_seconds: float = Field(
        default=300.0, gt=0, allow_inf_nan=False,
        description="the longest wait a provider's Retry-After or retry-after-ms imposes "
                    "(a rate-limit pause of a model for the fleet, a retry's delay); a "
                    "longer one is cut to this, one that is not a finite number is ignored")
    provider_learn_limits: bool = Field(
        default=True,
        description="read the providers' rate-limit headers: a budget above the limits "
                    "they state is brought down to them; with no budget set, one is made "
                    "from them")
    embeddings_provider: Literal["", "openai", "azure", "anthropic"] = Field(
        default="",
        description="the embeddings provider; empty: the chat provider when it has an "
                    "embeddings API (not anthropic)")
    embeddings_url: str = Field(default="", description="the embeddings provider's base "
                                "URL; empty: the chat provider's")
    embeddings_api_key: SecretStr = Field(default=SecretStr(""), description="the "
                                          "embeddings provider's key; empty: the chat key")
    embeddings_model: str = Field(default="", description="the embeddings model, e.g. "
                                  "text-embedding-3-small; empty: the chat model")
    embeddings_extra_headers: dict[str, str] = Field(
        default_factory=dict, description="headers sent with every embeddings call, JSON")
    embeddings_api_version: str = Field(default="", description="Azure OpenAI deployment "
                                        "URLs of the embeddings provider: api-version")

    # Workers.
    pool: str = Field(default="default", pattern=r"^[a-z][a-z0-9_-]{0,62}$",
                      description="the worker pool: a worker consumes calmq.<pool>.<priority>")
    priorities: str = Field(default="interactive,bulk",
                            description="priorities a worker consumes, first ahead of the rest")
    concurrency: int = Field(default=256, ge=1, le=100_000,
                             description="call slots per worker process (model calls at once)")
    interactive_reserve: int | None = Field(
        default=None, ge=0, le=100_000,
        description="call slots beyond concurrency that only interactive attempts may use, and"
                    " as many more interactive jobs held claimed (default: an eighth of the"
                    " in-flight window)")
    fair_share: bool = Field(
        default=True,
        description="fair share inside each lane: while a pool's priority is contended, new "
                    "jobs wait in PostgreSQL (waiting_reason fair_share) and free slots go to "
                    "the tenant furthest below its weighted share (calmq tenants set-weight)")
    fair_share_headroom: int | None = Field(
        default=None, ge=0, le=100_000,
        description="with fair share: call slots a tenant above its weighted share leaves "
                    "free while another tenant runs or waits in the lane, so that tenant's "
                    "next job starts at once (default: a 256th of concurrency, rounded down)")
    concurrency_release_batch: int = Field(
        default=256, ge=1, le=4096,
        description="concurrency keys one release pass locks at most (an advisory lock "
                    "each, in PostgreSQL's shared lock table); the next pass goes on from "
                    "the last, so every waiting key gets its turn")
    concurrency_keys_waiting_max: int = Field(
        default=1000, ge=1, le=1_000_000,
        description="distinct concurrency keys one tenant's jobs may wait for at once; past "
                    "them a job that must wait for its key waits behind the tenant's keys "
                    "(waiting_reason concurrency_keys_waiting) until one stops waiting")
    worker_id: str = ""
    lease_seconds: float = Field(default=30.0, gt=0)
    sweeper_grace_seconds: float = Field(
        default=600.0, gt=0,
        description="how long a queued job, or a retrying job past its due time, may wait"
                    " before the sweeper re-publishes it (it lost its message)")
    step_timeout_seconds: float | None = Field(
        default=None, gt=0, description="overrides every step's timeout (default: per step)")
    max_attempts: int | None = Field(
        default=None, ge=1, description="overrides every job's attempt budget (default: per step)")
    output_flush_seconds: float = Field(
        default=0.05, ge=0, le=5,
        description="streamed steps: a job's text is written to its followers at most this "
                    "often (the first piece at once); 0: every piece as it comes")
    commit_interval_ms: int = Field(default=200, ge=1)
    grace_seconds: float = Field(default=10.0, ge=0)

    # Retries: delay tiers are topics calmq.retry.<tier>.
    retry_tiers: str = "5s,30s,2m,10m,1h"
    retry_initial_seconds: float = Field(default=1.0, gt=0)
    retry_max_seconds: float = Field(default=3600.0, gt=0)
    retry_multiplier: float = Field(default=2.0, ge=1)

    # Topics.
    kafka_compression: Literal["none", "gzip", "snappy", "lz4", "zstd"] = Field(
        default="none",
        description="batch compression of every record calmq produces; none and gzip are read"
                    " by every mainstream client without a codec plugin (see"
                    " docs/reference/topics.md)")
    kafka_max_message_bytes: int = Field(
        default=1_000_000, ge=64 * 1024, le=100 * 1024 * 1024,
        description="the largest record calmq produces: the relay producer's "
                    "message.max.bytes, and max.message.bytes of the topics `calmq topics "
                    "create` makes (set together; a larger outbox row goes to calmq.dlq as "
                    "record_too_large)")
    topic_partitions: int = Field(default=8, ge=1)
    results_topic_per_tenant: bool = Field(
        default=False,
        description="each tenant's results to calmq.results.<tenant> and its dead letters to "
                    "calmq.results.<tenant>.dlq: `calmq tenants create` and `calmq topics "
                    "create` give every tenant without one its own topics (made first); "
                    "false: the shared calmq.results, except for tenants configured with "
                    "`calmq tenants results-topic`")
    topic_replication: int = Field(default=1, ge=1)
    topic_min_insync_replicas: int | None = Field(
        default=None, ge=1,
        description="min.insync.replicas of the topics calmq creates (default: the broker's;"
                    " with replication 3, set 2 so a write survives one broker down)")

    # Kafka clients: how every client (producer, consumer, admin, the relay, the lag readers,
    # `calmq lag`, the benchmarks) reaches a secured cluster. calmq.kafka.connection_config
    # turns these into librdkafka properties once per process.
    kafka_security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT",
        description="librdkafka security.protocol: PLAINTEXT, SSL (TLS, optionally mTLS),"
                    " SASL_PLAINTEXT or SASL_SSL")
    kafka_sasl_mechanism: Literal["", "PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512",
                                  "OAUTHBEARER"] = Field(
        default="", description="SASL mechanism when the protocol is SASL_*")
    kafka_sasl_username: str = Field(default="", description="SASL username (PLAIN, SCRAM)")
    kafka_sasl_password: SecretStr = Field(
        default=SecretStr(""), description="SASL password (PLAIN, SCRAM); a secret")
    kafka_sasl_oauthbearer_method: Literal["oidc", "aws_msk_iam"] = Field(
        default="oidc",
        description="OAUTHBEARER tokens: oidc (client credentials at a token endpoint) or"
                    " aws_msk_iam (signed with the AWS credentials chain; pip install"
                    " 'calmq[msk-iam]')")
    kafka_sasl_oauthbearer_token_endpoint_url: str = Field(
        default="", description="OAUTHBEARER oidc: the identity provider's token endpoint")
    kafka_sasl_oauthbearer_client_id: str = Field(
        default="", description="OAUTHBEARER oidc: the client id")
    kafka_sasl_oauthbearer_client_secret: SecretStr = Field(
        default=SecretStr(""), description="OAUTHBEARER oidc: the client secret; a secret")
    kafka_sasl_oauthbearer_scope: str = Field(
        default="", description="OAUTHBEARER oidc: scope to request (optional)")
    kafka_sasl_oauthbearer_extensions: str = Field(
        default="",
        description="OAUTHBEARER: SASL extensions, key=value,... (Confluent Cloud:"
                    " logicalCluster=lkc-...,identityPoolId=pool-...)")
    kafka_sasl_oauthbearer_aws_region: str = Field(
        default="", description="OAUTHBEARER aws_msk_iam: the cluster's AWS region (default:"
                                " the AWS SDK's region chain)")
    kafka_ssl_ca_location: str = Field(
        default="", description="PEM file of the CA(s) that signed the brokers' certificates"
                                " (default: the system's trust store)")
    kafka_ssl_certificate_location: str = Field(
        default="", description="PEM client certificate, for mTLS (Strimzi tls users)")
    kafka_ssl_key_location: str = Field(
        default="", description="PEM private key of the client certificate, for mTLS")
    kafka_ssl_key_password: SecretStr = Field(
        default=SecretStr(""), description="password of an encrypted client key; a secret")
    kafka_config: str = Field(
        default="",
        description="any other librdkafka properties for every client: a JSON object or"
                    " properties text (key=value lines; CALMQ_KAFKA_CONFIG_FILE reads a"
                    " .properties file); names are checked against librdkafka at start-up")

    # The schema registry's credentials and TLS (the URL may also carry user:password@).
    schema_registry_username: str = Field(
        default="", description="registry basic auth user (Confluent Cloud: the API key)")
    schema_registry_password: SecretStr = Field(
        default=SecretStr(""), description="registry basic auth password; a secret")
    schema_registry_bearer_token: SecretStr = Field(
        default=SecretStr(""), description="registry bearer token (instead of basic auth);"
                                           " a secret")
    schema_registry_ca_location: str = Field(
        default="", description="PEM file of the CA that signed the registry's certificate")
    schema_registry_certificate_location: str = Field(
        default="", description="PEM client certificate for the registry, for mTLS")
    schema_registry_key_location: str = Field(
        default="", description="PEM private key of the registry client certificate")
    schema_registry_config: str = Field(
        default="",
        description="any other registry client properties (confluent_kafka's names, e.g."
                    " bearer.auth.credentials.source=OAUTHBEARER and bearer.auth.client.id,"
                    " .client.secret, .scope, .issuer.endpoint.url, .logical.cluster,"
                    " .identity.pool.id for OAuth): a JSON object or key=value lines, as"
                    " kafka_config")

    # Relay.
    relay_mode: Literal["polling", "cdc"] = Field(
        default="cdc", description="cdc (logical replication, needs wal_level=logical) or polling")
    relay_batch: int = Field(default=2000, ge=1)
    relay_idle_ms: int = Field(default=5, ge=1)
    outbox_retention_seconds: float = Field(default=600.0, ge=0)
    # CDC relay: names are per database, slots are per server (a test database needs its own).
    relay_slot: str = Field(default="calmq_outbox", pattern=r"^[a-z_][a-z0-9_]{0,62}$",
                            description="CDC relay: the logical replication slot")
    relay_publication: str = Field(default="calmq_outbox", pattern=r"^[a-z_][a-z0-9_]{0,62}$")
    relay_wal_warn_bytes: int = Field(default=1 << 30, ge=1)
    relay_housekeeping_seconds: float = Field(default=5.0, gt=0)
    relay_prune_batch: int = Field(default=5000, ge=1)
    # Debezium's route.topic.replacement; ${routedByValue} is the row's aggregatetype. The
    # relay puts name_prefix in front of it (Debezium: <name_prefix>calmq.${routedByValue}).
    relay_topic_replacement: str = Field(default="calmq.${routedByValue}", min_length=1)
    # Many environments on one Kafka cluster and registry (calmq.topics.configure).
    name_prefix: str = Field(
        default="",
        description="put in front of every topic, consumer group and schema subject"
                    " (staging. gives staging.calmq.default.interactive): empty, or lower"
                    " case letters, digits, '.', '_', '-' ending in '.' or '-'")

    # Workflows.
    review_confidence_threshold: float = Field(default=0.9, ge=0, le=1)
    # Comma list of modules whose workflows() or WORKFLOWS the API and workers register,
    # besides the built-ins and the calmq.workflows entry points (docs/how-to/write-a-workflow.md).
    workflow_modules: str = ""
    # How long a job waits in awaiting_review before the review timer applies the
    # workflow's expiry outcome (a workflow may set its own).
    review_deadline_seconds: float = Field(default=48 * 3600.0, gt=0)
    # Where the invoice example workflow posts (POST with an Idempotency-Key header).
    ledger_url: str = ""

    # Fleet-wide token budget per provider and model (docs/explanation/token-budget.md).
    # Both limits 0: no shared budget, each worker meets the provider's 429s alone.
    budget_tokens_per_minute: int = Field(default=0, ge=0)  # the provider's limit; 0: none
    budget_requests_per_minute: int = Field(default=0, ge=0)  # 0: no request limit
    budget_interactive_share: float = Field(default=0.2, ge=0, lt=1)  # held for interactive
    budget_burst_seconds: float = Field(default=1.0, gt=0, le=30)  # bucket capacity, in time
    budget_slice_seconds: float = Field(default=0.25, gt=0, le=10)  # one lease, in time
    budget_lease_seconds: float = Field(default=0.5, gt=0, le=30)  # unspent slices go back
    budget_default_pause_seconds: float = Field(default=1.0, ge=0)  # 429 without Retry-After
    # A worker claims no more bulk work than its share of the budget serves in this long, so
    # claimed jobs do not wait for budget past their step timeout (keep it well below it).
    budget_queue_seconds: float = Field(default=15.0, gt=0)
    # OpenAI-style providers count max_tokens against the limit when they admit a call;
    # false for providers that count only the tokens generated.
    budget_counts_max_tokens: bool = True
    # Each tenant's token quota, by default: budget_tokens_per_minute divided among the
    # tenants active in the last minute, never less than this share of it (a tenant row's
    # tokens_per_minute overrides it: `calmq tenants set-quota`). 1: no default quota.
    budget_tenant_share: float = Field(default=0.5, gt=0, le=1)
    # How far a tenant's interactive calls may take its token quota into debt, in seconds of
    # that quota: its bulk backlog never holds its interactive work back, and past this
    # debt its interactive work waits for its quota too (ahead of its bulk), so no tenant
    # takes the fleet's budget through the interactive priority.
    budget_interactive_debt_seconds: float = Field(default=10.0, ge=0, le=600)
    # Spend caps in USD (0: none) for the whole fleet; a tenant's own are on its row
    # (`calmq tenants set-spend-cap`). Bulk work waits once spend reaches this fraction of a
    # cap, interactive work at the full cap, so interactive work is held last.
    spend_cap_fleet_daily_usd: float = Field(default=0.0, ge=0)
    spend_cap_fleet_monthly_usd: float = Field(default=0.0, ge=0)
    spend_cap_bulk_fraction: float = Field(default=0.9, gt=0, le=1)
    spend_cap_refresh_seconds: float = Field(default=5.0, gt=0, le=3600)
    # Interactive jobs should start within this long of their submission (p95); the budget
    # integration test holds the fleet to it.
    interactive_wait_seconds: float = Field(default=10.0, gt=0)
    # USD per million tokens by model (or provider:model), JSON:
    # {"gpt-4o-mini": {"input": 0.15, "output": 0.6}}. Replaces the defaults when set.
    prices: dict[str, ModelPrice] = Field(default_factory=lambda: dict(DEFAULT_PRICES))
    prices_table: bool = Field(
        default=True,
        description="price models CALMQ_PRICES lacks from the genai-prices table (cached "
                    "input, service tiers); false: such models cost 0")

    # Service tiers (docs/how-to/deadlines-and-tiers.md, calmq.calls.tiers): the tiers calmq
    # may ask of OpenAI per call, from the time the job has left.
    service_tiers: str = Field(
        default="",
        description="comma list of the OpenAI service tiers calmq may choose per call: flex "
                    "(bulk jobs whose deadline holds a flex call), priority (only where the "
                    "standard tier would miss it); each must be priced for CALMQ_MODEL. "
                    "Empty: no tier is sent")
    service_tier_priority_tenants: str = Field(
        default="",
        description="comma list of tenant ids whose calls may be sent at priority (empty: "
                    "every tenant, when service_tiers names priority)")
    service_tier_flex_seconds: float = Field(
        default=900.0, gt=0,
        description="a flex call's latency assumed until flex calls have answered (then "
                    "the 90th percentile of the last 64 is used)")
    service_tier_standard_seconds: float = Field(
        default=60.0, gt=0,
        description="a standard call's latency assumed until standard calls have answered")
    service_tier_margin: float = Field(
        default=1.5, ge=1,
        description="the factor on a tier's latency when calmq checks it meets the time a "
                    "job has left")

    # The batch lane (docs/how-to/batch-backfills.md): jobs submitted with "lane": "batch"
    # go through the provider's batch API at its batch price, collected by `calmq batcher`.
    batch_completion_window_seconds: float = Field(
        default=24 * 3600.0, gt=0,
        description="the provider's batch completion window (OpenAI and Anthropic: 24 h)")
    batch_deadline_margin_seconds: float = Field(
        default=3600.0, ge=0,
        description="a batch-lane job's deadline must leave the window plus this; a shorter "
                    "one is refused (422 deadline_too_short_for_batch)")
    batch_max_requests: int = Field(
        default=50_000, ge=1, le=100_000,
        description="requests per provider batch at most (OpenAI 50,000; Anthropic 100,000)")
    batch_max_bytes: int = Field(
        default=200 * 1024 * 1024, ge=1024,
        description="bytes of requests per provider batch at most (OpenAI 200 MB; "
                    "Anthropic 256 MB)")
    batch_max_age_seconds: float = Field(
        default=60.0, gt=0,
        description="a batch being packed is sent at the latest this long after its first job")
    batch_poll_interval_seconds: float = Field(
        default=30.0, gt=0, description="how often the poller asks the provider about a batch")
    batch_lease_seconds: float = Field(
        default=60.0, gt=0,
        description="a poller's lease on a batch it collects (one poller per batch)")
    batch_max_result_line_bytes: int = Field(
        default=16 * 1024 * 1024, ge=64 * 1024,
        description="the longest line of a provider's batch results file the poller reads "
                    "(one request's result); a longer one fails its request as "
                    "batch_result_too_large, unread")
    batch_enqueued_tokens_limit: int = Field(
        default=0, ge=0,
        description="the provider's batch queue limit in tokens per model (estimated, prompt "
                    "+ max_tokens); the batcher waits while open batches hold that many; 0: none")

    # Kubernetes manifests and KEDA (`calmq k8s render`, docs/how-to/autoscaling.md). The cap
    # reads budget_tokens_per_minute (0: no budget, partitions alone bound the fleet) and
    # these two estimates, which a running fleet's metrics refine.
    keda_pools: str = Field(
        default="", description="comma list of pools (default: every pool the workflows use)")
    keda_namespace: str = Field(
        default="calmq", description="the namespace `calmq k8s render` renders into")
    image: str = Field(
        default=f"{IMAGE_REPOSITORY}:{__version__}",
        description="the calmq image every rendered container runs (CALMQ_KEDA_IMAGE, its "
                    "old name, is read for one more release)")
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = Field(
        default="IfNotPresent", description="imagePullPolicy of every rendered container")
    image_pull_secrets: str = Field(
        default="", description="comma list of Secrets the rendered pods pull the image with")
    keda_lag_threshold: int | None = Field(
        default=None, ge=1,
        description="KEDA lagThreshold, messages of lag per replica (default: the worker's"
                    " in-flight window, concurrency + an eighth)")
    keda_min_replicas: int | None = Field(
        default=None, ge=0,
        description="KEDA minReplicaCount of every pool (default: 1 for a pool that takes "
                    "interactive work, 0 for a bulk-only pool)")
    keda_tokens_per_job: int = Field(default=8_000, ge=1)  # estimate: prompt + completion
    keda_seconds_per_call: float = Field(default=10.0, gt=0)  # estimate: one model call

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    cli_state_dir: str = Field(
        default="",
        description="where the CLI writes bulk checkpoints (default: $XDG_STATE_HOME/calmq or"
                    " ~/.local/state/calmq, else a folder under the temporary directory when"
                    " neither can be written, as in the image)")
    metrics_host: str = Field(
        default="0.0.0.0",
        description="address --metrics-port listens on (relay, worker, forwarder, reaper);"
                    " calmq dev up sets 127.0.0.1")
    # Observability (docs/how-to/observability.md): input fields logs may not show ("*" all,
    # "" none, or a comma list), and how often the gauges read from PostgreSQL and Kafka are
    # sampled (0 turns a sampler off).
    log_redact_fields: str = "*"
    queue_age_interval_seconds: float = Field(default=5.0, ge=0)
    consumer_lag_interval_seconds: float = Field(default=5.0, ge=0)
    # Dead tuples, wraparound and the oldest transaction: slow-moving, and the statistics
    # view grows with the history partitions, so a minute apart rather than five seconds.
    table_health_interval_seconds: float = Field(default=60.0, ge=0)

    @field_validator("prices", "provider_extra_headers", "structured_outputs",
                     "embeddings_extra_headers", mode="before")
    @classmethod
    def _prices_from_json(cls, value: Any) -> Any:
        # Settings.load(environ=...) hands the raw environment string over unparsed.
        if isinstance(value, str):
            import json

            try:
                return json.loads(value)
            except ValueError as exc:
                raise ValueError(f"must be a JSON object: {exc}") from None
        return value

    @field_validator("kafka_security_protocol", "kafka_sasl_mechanism", mode="before")
    @classmethod
    def _upper_case(cls, value: Any) -> Any:
        # librdkafka reads both cases; the docs of every cloud print them differently.
        return value.strip().upper() if isinstance(value, str) else value

    @field_validator("kafka_config")
    @classmethod
    def _kafka_properties(cls, value: str) -> str:
        kafka_properties(value)  # raises on what cannot be read or is calmq's own
        return value

    @field_validator("schema_registry_config")
    @classmethod
    def _registry_properties(cls, value: str) -> str:
        registry_properties(value)  # raises on what cannot be read or has a setting
        return value

    @field_validator("name_prefix")
    @classmethod
    def _name_prefix(cls, value: str) -> str:
        from calmq.topics import check_name_prefix

        return check_name_prefix(value)

    @field_validator("priorities")
    @classmethod
    def _known_priorities(cls, value: str) -> str:
        names = [p.strip() for p in value.split(",") if p.strip()]
        unknown = [p for p in names if p not in tuple(Priority)]
        if not names or unknown:
            raise ValueError("priorities is a comma list of interactive and bulk")
        return ",".join(names)

    @field_validator("retry_tiers")
    @classmethod
    def _tiers_are_durations(cls, value: str) -> str:
        tiers = [t.strip() for t in value.split(",") if t.strip()]
        if not tiers:
            raise ValueError("retry_tiers needs at least one tier such as 5s")
        delays = [parse_duration(t) for t in tiers]
        if delays != sorted(delays):
            raise ValueError("retry_tiers must be in increasing order")
        return ",".join(tiers)

    @field_validator("service_tiers")
    @classmethod
    def _choosable_tiers(cls, value: str) -> str:
        tiers = [t.strip() for t in value.split(",") if t.strip()]
        unknown = [t for t in tiers if t not in ("flex", "priority")]
        if unknown:
            raise ValueError(f"service_tiers is a comma list of flex and priority, not "
                             f"{', '.join(unknown)}")
        return ",".join(tiers)

    @model_validator(mode="after")
    def _tiers_are_priced(self) -> Settings:
        """A tier calmq may choose must have a price for the configured model: refused here,
        never billed at the standard price or at 0 (calmq.calls.pricing.tier_price)."""
        if not self.service_tiers:
            return self
        if self.provider != "openai":
            raise ValueError(f"service_tiers: service tiers are chosen for OpenAI's API; "
                             f"CALMQ_PROVIDER is {self.provider}")
        refused = []
        for tier in self.service_tier_list:
            try:
                tier_price(self.prices, self.provider, self.model, tier,
                           table=self.prices_table)
            except ConfigError as exc:
                refused.append(exc.message)
        if refused:
            raise ValueError("service_tiers: " + "; ".join(refused))
        return self

    @property
    def service_tier_list(self) -> list[str]:
        return [t for t in self.service_tiers.split(",") if t]

    @property
    def service_tier_priority_tenant_list(self) -> list[str]:
        return [t.strip() for t in self.service_tier_priority_tenants.split(",") if t.strip()]

    @property
    def priority_list(self) -> list[str]:
        return self.priorities.split(",")

    @property
    def retry_tier_list(self) -> list[tuple[str, float]]:
        return [(t, parse_duration(t)) for t in self.retry_tiers.split(",")]

    @property
    def listen_database_url(self) -> str:
        """Where LISTEN sessions connect: never through a transaction pooler, which hands
        the server connection to another client after each transaction."""
        if self.database_pooler == "transaction" and not self.direct_database_url:
            raise ConfigError(
                "CALMQ_DATABASE_POOLER=transaction: LISTEN cannot go through the pooler; set "
                "CALMQ_DIRECT_DATABASE_URL to a direct connection", code="direct_url_missing")
        return self.direct_database_url or self.database_url

    @property
    def kafka_properties(self) -> dict[str, Any]:
        """``kafka_config`` parsed: the extra librdkafka properties of every client."""
        return kafka_properties(self.kafka_config)

    @property
    def effective_provider_url(self) -> str:
        return self.provider_url or self.fake_provider_url

    @property
    def embeddings_endpoint(self) -> tuple[str, str, str, str, dict[str, str], str] | None:
        """(kind, URL, key, model, extra headers, api-version) of the embeddings provider;
        None when there is none (the chat provider is Anthropic and none is set)."""
        kind = self.embeddings_provider or self.provider
        if kind == "anthropic":
            return None
        model = self.embeddings_model or self.model
        if self.embeddings_provider or self.embeddings_url:  # a provider of its own
            return (kind, self.embeddings_url or self.fake_provider_url,
                    self.embeddings_api_key.get_secret_value(),
                    model, dict(self.embeddings_extra_headers), self.embeddings_api_version)
        return (kind, self.effective_provider_url, self.provider_api_key.get_secret_value(),
                model, dict(self.provider_extra_headers), self.provider_api_version)

    @property
    def effective_migrate_database_url(self) -> str:
        return self.migrate_database_url or self.database_url

    @property
    def effective_relay_database_url(self) -> str:
        """The relay's connection: its own role's, and never through a transaction pooler
        (replication cannot go through one at all)."""
        if self.database_pooler == "transaction" and not self.relay_database_url:
            raise ConfigError(
                "CALMQ_DATABASE_POOLER=transaction: logical replication cannot go through the "
                "pooler; set CALMQ_RELAY_DATABASE_URL to a direct connection",
                code="direct_url_missing")
        return self.relay_database_url or self.database_url

    @classmethod
    def load(
        cls, overrides: Mapping[str, Any] | None = None, environ: Mapping[str, str] | None = None
    ) -> Settings:
        """Settings from the environment, with ``overrides`` (flags) taking precedence.

        Raises ConfigError naming every unknown ``CALMQ_`` variable or invalid value.
        """
        env = os.environ if environ is None else environ
        links = service_links(env)
        # A link that has a setting's name (CALMQ_API_PORT=tcp://...) shadows it: the
        # setting keeps its default, passed explicitly because pydantic-settings reads
        # os.environ itself for any field it is not given.
        shadowed: dict[str, Any] = {}
        if links:
            _warn_links(links)
            env = {k: v for k, v in env.items() if k not in links}
            environ = env
            shadowed = {name: field.default for name, field in cls.model_fields.items()
                        if ENV_PREFIX + name.upper() in links}
        env = _renamed(env)
        if environ is not None or env is not os.environ:
            environ = env
        known = {ENV_PREFIX + name.upper() for name in cls.model_fields}
        from_files = {ENV_PREFIX + name.upper() + FILE_SUFFIX: name for name in cls.model_fields}
        unknown = sorted(
            k
            for k in env
            if k.startswith(ENV_PREFIX) and k not in known and k not in from_files
            and k not in _NON_SETTING_ENV
        )
        if unknown:
            env = _unknown(env, unknown)
            environ = env
        files = _read_setting_files(env, from_files)
        clean = {k: v for k, v in (overrides or {}).items() if v is not None}
        try:
            if environ is None:
                return cls(**{**files, **clean})
            values = {
                name: env[ENV_PREFIX + name.upper()]
                for name in cls.model_fields
                if ENV_PREFIX + name.upper() in env
            }
            values.update(files)
            values.update(shadowed)
            values.update(clean)
            return cls.model_validate(values)
        except ValidationError as exc:
            problems = "; ".join(
                f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors()
            )
            raise ConfigError(f"invalid settings: {problems}") from exc


def _read_setting_files(env: Mapping[str, str], from_files: Mapping[str, str]) -> dict[str, str]:
    """Settings named by ``CALMQ_<NAME>_FILE``: each file's text, less one final newline (a
    Secret's key written with ``echo`` has one; a password never ends in it)."""
    values: dict[str, str] = {}
    for variable, name in from_files.items():
        path = env.get(variable)
        if path is None:
            continue
        direct = variable[: -len(FILE_SUFFIX)]
        if direct in env:
            raise ConfigError(f"both {direct} and {variable} are set: keep one",
                              code="conflicting_setting")
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except OSError as exc:
            raise ConfigError(f"{variable}: cannot read {path}: {exc.strerror or exc}",
                              code="unreadable_setting_file") from None
        except UnicodeDecodeError:
            raise ConfigError(f"{variable}: {path} is not UTF-8 text",
                              code="unreadable_setting_file") from None
        values[name] = text.removesuffix("\n").removesuffix("\r")
    return values


def _renamed(env: Mapping[str, str]) -> Mapping[str, str]:
    """``env`` with each old variable name read as its setting's new one (the new name
    wins when both are set), and a warning naming the change."""
    old = [k for k in _ALIASES if k in env]
    if not old:
        return env
    out = {k: v for k, v in env.items() if k not in old}
    for name in old:
        new = ENV_PREFIX + _ALIASES[name].upper()
        out.setdefault(new, env[name])
        log.warning("%s is the old name of %s; it is read for one more release", name, new)
    return out


def _unknown(env: Mapping[str, str], unknown: list[str]) -> Mapping[str, str]:
    """Unknown ``CALMQ_`` variables are an error; with CALMQ_STRICT_SETTINGS=false (what
    the rendered pods set: their ConfigMap may hold a setting an older or newer release
    does not know, during an upgrade or a rollback) a warning, and they are dropped."""
    message = (f"unknown setting(s) {', '.join(unknown)}; see docs/reference/settings.md "
               "for the names calmq reads")
    if env.get(STRICT_ENV, "true").strip().lower() not in ("false", "0", "no"):
        raise ConfigError(message, code="unknown_setting")
    log.warning("%s (ignored: %s=false)", message, STRICT_ENV)
    return {k: v for k, v in env.items() if k not in unknown}


def _warn_links(links: list[str]) -> None:
    global _warned_links
    if _warned_links:
        return
    _warned_links = True
    log.warning(
        "ignoring %s: they look like Kubernetes service links (a Service whose name starts"
        " with calmq), not calmq settings; set enableServiceLinks: false in the pod spec to"
        " avoid them (docs/how-to/deploy-kubernetes.md)", ", ".join(links))
