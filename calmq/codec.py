"""Avro encoding of job events, behind one interface with two wire formats.

- ``RegistryCodec``: the Confluent wire format (magic byte 0, 4-byte schema id, Avro body),
  with ids from a Confluent-compatible schema registry through
  ``confluent_kafka.schema_registry``. Used when ``CALMQ_SCHEMA_REGISTRY_URL`` is set.
- ``SingleObjectCodec``: Avro single-object encoding (``C3 01``, the 8-byte CRC-64-AVRO
  fingerprint of the writer schema, Avro body), with ``schemas/`` as the schema store. The
  embedded default, because no Confluent-compatible registry runs from the package
  registries this project can reach (see docs/reference/topics.md).

Both read every version in ``schemas/`` and decode into the newest one, so a consumer
upgraded before its producers keeps working (BACKWARD evolution, schemas/README.md).
"""

from __future__ import annotations

import io
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import fastavro
from fastavro.schema import fingerprint, to_parsing_canonical_form

from calmq.errors import ConfigError, ContractError, InfrastructureError

if TYPE_CHECKING:
    from confluent_kafka.schema_registry import SchemaRegistryClient

    from calmq.settings import Settings

__all__ = [
    "EVENT_TYPES",
    "EventCodec",
    "RegistryCodec",
    "SchemaStore",
    "SingleObjectCodec",
    "check_registry",
    "decode_message",
    "make_codec",
    "registry_config",
]

# eventType header -> folder in schemas/
EVENT_TYPES = {
    "job.requested": "job_requested",
    "job.result": "job_result",
    "job.dead_lettered": "job_dead_lettered",
}

_SINGLE_OBJECT_MAGIC = b"\xc3\x01"
_CONFLUENT_MAGIC = 0


def default_schemas_dir() -> Path:
    # calmq/schemas: the repository's schemas/ in a checkout, package data when installed.
    return Path(__file__).parent / "schemas"


@dataclass(frozen=True)
class SchemaVersion:
    event_type: str
    version: int
    text: str  # the .avsc file as written, what a registry stores
    parsed: Any  # fastavro's parsed schema

    @property
    def fingerprint(self) -> bytes:
        canonical = to_parsing_canonical_form(self.parsed)
        return bytes.fromhex(fingerprint(canonical, "CRC-64-AVRO"))


class SchemaStore:
    """Every version of every event schema found in ``schemas/<event>/v<N>.avsc``."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = root or default_schemas_dir()
        self.versions: dict[str, list[SchemaVersion]] = {}
        for event_type, folder in EVENT_TYPES.items():
            found = []
            for path in (self.root / folder).glob("v*.avsc"):
                text = path.read_text("utf-8")
                # _named_schemas keeps each parse independent: versions reuse record names.
                parsed = fastavro.parse_schema(json.loads(text), named_schemas={})
                found.append(SchemaVersion(event_type, int(path.stem[1:]), text, parsed))
            if not found:
                raise ContractError(f"no schema for {event_type} under {self.root / folder}")
            self.versions[event_type] = sorted(found, key=lambda v: v.version)

    def latest(self, event_type: str) -> SchemaVersion:
        try:
            return self.versions[event_type][-1]
        except KeyError:
            raise ContractError(
                f"unknown event type {event_type!r}; known: {', '.join(EVENT_TYPES)}",
                code="unknown_event_type",
            ) from None


class EventCodec(Protocol):
    """Turns an event dict into message bytes and back."""

    def encode(self, event_type: str, record: dict[str, Any]) -> bytes: ...

    def decode(self, data: bytes) -> tuple[str, dict[str, Any]]: ...


def _write(schema: SchemaVersion, record: dict[str, Any], prefix: bytes) -> bytes:
    buf = io.BytesIO()
    buf.write(prefix)
    try:
        fastavro.schemaless_writer(buf, schema.parsed, record)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise ContractError(
            f"{schema.event_type} does not fit schema v{schema.version}: {exc}",
            code="schema_mismatch",
        ) from exc
    return buf.getvalue()


def _read(body: io.BytesIO, writer: SchemaVersion, reader: SchemaVersion) -> dict[str, Any]:
    try:
        record = fastavro.schemaless_reader(body, writer.parsed, reader.parsed)
    except (ValueError, TypeError, EOFError, IndexError, KeyError) as exc:
        raise ContractError(
            f"cannot decode {writer.event_type} v{writer.version}: {exc}", code="undecodable"
        ) from exc
    if not isinstance(record, dict):
        raise ContractError(f"{writer.event_type} did not decode to a record", code="undecodable")
    return record


class SingleObjectCodec:
    """Avro single-object encoding with ``schemas/`` as the schema store."""

    def __init__(self, store: SchemaStore | None = None) -> None:
        self.store = store or SchemaStore()
        self._by_fingerprint = {
            v.fingerprint: v for versions in self.store.versions.values() for v in versions
        }
        self._prefix = {
            event_type: _SINGLE_OBJECT_MAGIC + self.store.latest(event_type).fingerprint
            for event_type in self.store.versions
        }

    def encode(self, event_type: str, record: dict[str, Any]) -> bytes:
        schema = self.store.latest(event_type)
        return _write(schema, record, self._prefix[event_type])

    def decode(self, data: bytes) -> tuple[str, dict[str, Any]]:
        if len(data) < 10 or data[:2] != _SINGLE_OBJECT_MAGIC:
            raise ContractError(
                "not an Avro single-object message (expected C3 01 and a fingerprint)",
                code="undecodable",
            )
        writer = self._by_fingerprint.get(data[2:10])
        if writer is None:
            raise ContractError(
                f"unknown schema fingerprint {data[2:10].hex()}", code="unknown_schema"
            )
        reader = self.store.latest(writer.event_type)
        return writer.event_type, _read(io.BytesIO(data[10:]), writer, reader)


class RegistryCodec:
    """Confluent wire format with ids from a Confluent-compatible schema registry.

    Subjects follow the RecordNameStrategy (``dev.calmq.events.JobRequested``), so several
    event types may share a topic; ``subject_prefix`` (setting name_prefix) goes in front, so
    environments sharing a registry register and evolve their schemas apart. Ids are fetched
    once and cached. Writing looks the newest schema's id up (read-only); registering is a
    deployment step (``calmq schemas register``, which ``calmq dev up`` runs), so the
    services need no write access to the registry.
    """

    def __init__(self, registry_url: str, store: SchemaStore | None = None, *,
                 client: SchemaRegistryClient | None = None,
                 config: Mapping[str, Any] | None = None, subject_prefix: str = "") -> None:
        from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

        self.store = store or SchemaStore()
        # new_client gives the in-memory registry for mock:// URLs (unit tests only; one per
        # client, so tests share one by passing ``client``). ``config``: registry_config's
        # credentials and TLS settings.
        self._client = client or SchemaRegistryClient.new_client(
            {**(config or {}), "url": registry_url})
        self._schema_cls = Schema
        self.subject_prefix = subject_prefix
        self._ids: dict[str, int] = {}
        self._by_id: dict[int, SchemaVersion] = {}

    def subject(self, schema: SchemaVersion) -> str:
        parsed = json.loads(schema.text)
        return f"{self.subject_prefix}{parsed['namespace']}.{parsed['name']}"

    def register_all(self) -> dict[str, int]:
        """Register every version, oldest first, so the registry checks each step."""
        for versions in self.store.versions.values():
            for version in versions:
                schema_id = self._client.register_schema(
                    self.subject(version), self._schema_cls(version.text, "AVRO")
                )
                self._by_id[schema_id] = version
            self._ids[versions[-1].event_type] = schema_id
        return dict(self._ids)

    def encode(self, event_type: str, record: dict[str, Any]) -> bytes:
        schema = self.store.latest(event_type)
        schema_id = self._ids.get(event_type)
        if schema_id is None:
            schema_id = self._ids[event_type] = self._registered_id(schema)
        return _write(schema, record, struct.pack(">bI", _CONFLUENT_MAGIC, schema_id))

    def _registered_id(self, schema: SchemaVersion) -> int:
        """The registry's id of ``schema`` under its subject, looked up without writing."""
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        subject = self.subject(schema)
        try:
            found = self._client.lookup_schema(subject, self._schema_cls(schema.text, "AVRO"))
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:
                raise InfrastructureError(
                    f"{schema.event_type} v{schema.version} is not registered under subject "
                    f"{subject}: run `calmq schemas register` (a deployment step) first",
                    code="schema_not_registered") from exc
            raise InfrastructureError(f"schema registry lookup of {subject}: {exc}",
                                      code="schema_registry_unavailable") from exc
        except Exception as exc:  # requests/httpx errors of the client: the registry is away
            raise InfrastructureError(f"schema registry lookup of {subject}: {exc}",
                                      code="schema_registry_unavailable") from exc
        if found.schema_id is None:
            raise InfrastructureError(f"the registry returned no id for {subject}",
                                      code="schema_registry_unavailable")
        self._by_id[found.schema_id] = schema
        return int(found.schema_id)

    def decode(self, data: bytes) -> tuple[str, dict[str, Any]]:
        if len(data) < 5 or data[0] != _CONFLUENT_MAGIC:
            raise ContractError("not a Confluent wire-format message", code="undecodable")
        schema_id = struct.unpack(">I", data[1:5])[0]
        writer = self._by_id.get(schema_id)
        if writer is None:
            writer = self._lookup(schema_id)
        reader = self.store.latest(writer.event_type)
        return writer.event_type, _read(io.BytesIO(data[5:]), writer, reader)

    def knows(self, data: bytes) -> bool:
        """Whether ``decode`` can read ``data`` without asking the registry (its writer
        schema is cached, or the bytes are not wire format at all): a caller on an event
        loop decodes the others in a thread, since the registry call blocks."""
        if len(data) < 5 or data[0] != _CONFLUENT_MAGIC:
            return True
        return struct.unpack(">I", data[1:5])[0] in self._by_id

    def _lookup(self, schema_id: int) -> SchemaVersion:
        from confluent_kafka.schema_registry.error import SchemaRegistryError

        try:
            text = self._client.get_schema(schema_id).schema_str or ""
        except SchemaRegistryError as exc:
            if exc.http_status_code == 404:  # the registry answered: no such schema
                raise ContractError(f"unknown schema id {schema_id}",
                                    code="unknown_schema") from exc
            # A 5xx, a 401/403, a timeout the client reported as an error: the registry's
            # fault, not the message's. Never poison: the caller tries again later.
            raise InfrastructureError(f"schema registry lookup of id {schema_id}: {exc}",
                                      code="schema_registry_unavailable") from exc
        except Exception as exc:  # the HTTP client's connection errors: the registry is away
            raise InfrastructureError(f"schema registry lookup of id {schema_id}: {exc}",
                                      code="schema_registry_unavailable") from exc
        parsed = fastavro.parse_schema(json.loads(text), named_schemas={})
        canonical = to_parsing_canonical_form(parsed)
        for versions in self.store.versions.values():
            for version in versions:
                if to_parsing_canonical_form(version.parsed) == canonical:
                    self._by_id[schema_id] = version
                    return version
        raise ContractError(f"schema id {schema_id} is not a calmq event", code="unknown_schema")


def registry_config(settings: Settings) -> dict[str, Any]:
    """The registry client's credentials and TLS settings (``confluent_kafka``'s names),
    without the URL. Raises ConfigError naming the settings that do not fit together."""
    from calmq.settings import registry_properties

    s = settings
    config: dict[str, Any] = {}
    password = s.schema_registry_password.get_secret_value()
    token = s.schema_registry_bearer_token.get_secret_value()
    if s.schema_registry_username or password:
        if not (s.schema_registry_username and password):
            missing = ("CALMQ_SCHEMA_REGISTRY_PASSWORD" if s.schema_registry_username
                       else "CALMQ_SCHEMA_REGISTRY_USERNAME")
            raise ConfigError(f"registry basic auth needs {missing} too",
                              code="registry_credentials_missing")
        if token:
            raise ConfigError("set CALMQ_SCHEMA_REGISTRY_BEARER_TOKEN or basic auth "
                              "(CALMQ_SCHEMA_REGISTRY_USERNAME/PASSWORD), not both",
                              code="conflicting_setting")
        if "@" in s.schema_registry_url.split("://", 1)[-1].split("/", 1)[0]:
            raise ConfigError("the registry URL carries user:password@ and "
                              "CALMQ_SCHEMA_REGISTRY_USERNAME is set: keep one",
                              code="conflicting_setting")
        config["basic.auth.user.info"] = f"{s.schema_registry_username}:{password}"
    elif token:
        # The client's STATIC_TOKEN source also sends Confluent Cloud's target-sr-cluster
        # header; empty here, which other registries ignore.
        config.update({"bearer.auth.credentials.source": "STATIC_TOKEN",
                       "bearer.auth.token": token, "bearer.auth.logical.cluster": ""})
    for setting, key in (("schema_registry_ca_location", "ssl.ca.location"),
                         ("schema_registry_certificate_location", "ssl.certificate.location"),
                         ("schema_registry_key_location", "ssl.key.location")):
        if getattr(s, setting):
            config[key] = getattr(s, setting)
    if s.schema_registry_key_location and not s.schema_registry_certificate_location:
        raise ConfigError("CALMQ_SCHEMA_REGISTRY_KEY_LOCATION needs "
                          "CALMQ_SCHEMA_REGISTRY_CERTIFICATE_LOCATION",
                          code="registry_credentials_missing")
    extra = registry_properties(s.schema_registry_config)
    if "bearer.auth.credentials.source" in extra and (
            token or s.schema_registry_username or password):
        raise ConfigError("CALMQ_SCHEMA_REGISTRY_CONFIG sets bearer.auth.credentials.source: "
                          "unset CALMQ_SCHEMA_REGISTRY_BEARER_TOKEN and basic auth",
                          code="conflicting_setting")
    return {**config, **extra}


def check_registry(url: str, config: Mapping[str, Any] | None = None,
                   timeout: float = 3.0) -> int:
    """How many subjects the registry lists (``GET /subjects``) with these credentials.

    A refused credential or an untrusted certificate is a ConfigError naming the setting
    to change; a registry that does not answer is InfrastructureError
    (``registry_unreachable``).
    """
    from confluent_kafka.schema_registry import SchemaRegistryClient
    from confluent_kafka.schema_registry.error import SchemaRegistryError

    shown = _without_userinfo(url)
    try:
        client = SchemaRegistryClient({**(config or {}), "url": url, "timeout": timeout,
                                       "max.retries": 0})
        return len(client.get_subjects())
    except SchemaRegistryError as exc:
        if exc.http_status_code in (401, 403):
            raise ConfigError(
                f"the schema registry at {shown} refused the credentials (HTTP "
                f"{exc.http_status_code}): set CALMQ_SCHEMA_REGISTRY_USERNAME and "
                "CALMQ_SCHEMA_REGISTRY_PASSWORD, or CALMQ_SCHEMA_REGISTRY_BEARER_TOKEN",
                code="registry_authentication_failed") from None
        reason = f"HTTP {exc.http_status_code} from /subjects"
    except (ValueError, TypeError, OSError) as exc:
        if "CERTIFICATE_VERIFY_FAILED" in str(exc) or "certificate verify failed" in str(exc):
            raise ConfigError(
                f"the schema registry at {shown}: its TLS certificate is not trusted: set "
                "CALMQ_SCHEMA_REGISTRY_CA_LOCATION to the PEM file of the CA that signed it",
                code="registry_tls_untrusted") from None
        if isinstance(exc, ValueError | TypeError):
            raise ConfigError(f"schema registry settings: {exc}",
                              code="invalid_setting") from None
        reason = str(exc)
    except Exception as exc:  # noqa: BLE001 - the HTTP client's errors: away or refused
        text = str(exc)
        if "CERTIFICATE_VERIFY_FAILED" in text or "certificate verify failed" in text:
            raise ConfigError(
                f"the schema registry at {shown}: its TLS certificate is not trusted: set "
                "CALMQ_SCHEMA_REGISTRY_CA_LOCATION to the PEM file of the CA that signed it",
                code="registry_tls_untrusted") from None
        reason = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    raise InfrastructureError(
        f"the schema registry at {shown} is not reachable ({reason}): check "
        "CALMQ_SCHEMA_REGISTRY_URL", code="registry_unreachable")


def _without_userinfo(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    return f"{scheme}{sep}{host.rsplit('@', 1)[-1]}{slash}{path}"


def make_codec(schema_registry_url: str,
               config: Mapping[str, Any] | None = None, subject_prefix: str = "") -> EventCodec:
    """The registry codec when a registry URL is set, else single-object encoding.
    ``config``: registry_config(settings), the registry's credentials and TLS;
    ``subject_prefix``: setting name_prefix."""
    if schema_registry_url:
        return RegistryCodec(schema_registry_url, config=config, subject_prefix=subject_prefix)
    return SingleObjectCodec()


def decode_message(codec: EventCodec, data: bytes,
                   event_type: str | None) -> tuple[str, dict[str, Any]]:
    """A message's event: calmq's Avro through ``codec``, or the Debezium connector's JSON.

    The Outbox Event Router with the ``JsonConverter`` (schemas disabled, payload expanded)
    writes the outbox ``payload`` as a JSON object and the event type in the ``eventType``
    header (``deploy/debezium/calmq-outbox-connector.json``). Such a value is checked against
    the newest Avro schema of that type, exactly as the relay would encode it, and read back
    through the schema, so both encodings yield the same dict (defaults filled in).
    """
    if data[:1] != b"{":  # Avro (single-object C3 01, Confluent 00) never starts with "{"
        return codec.decode(data)
    if not event_type:
        raise ContractError("a JSON event without an eventType header", code="undecodable")
    store = getattr(codec, "store", None) or SchemaStore()
    schema = store.latest(event_type)
    try:
        record = json.loads(data)
    except ValueError as exc:
        raise ContractError(f"{event_type}: not JSON: {exc}", code="undecodable") from exc
    if not isinstance(record, dict):
        raise ContractError(f"{event_type}: JSON value is not an object", code="undecodable")
    if isinstance(record.get("raw_value"), str):
        # jsonb holds no bytes: calmq.events stores an unreadable message as latin-1 text.
        record["raw_value"] = record["raw_value"].encode("latin-1")
    body = _write(schema, record, b"")
    return event_type, _read(io.BytesIO(body), schema, schema)
