"""Kafka wiring: client configurations, topic creation, headers. Topic names: calmq.topics."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from calmq.errors import ConfigError, InfrastructureError

if TYPE_CHECKING:
    from calmq.settings import Settings

__all__ = [
    "COMPRESSIONS",
    "CONSUMER_KEYS",
    "DEFAULT_COMPRESSION",
    "Connection",
    "check_connection",
    "connection_config",
    "connection_of",
    "consumer_config",
    "create_topics",
    "header",
    "headers_dict",
    "produce",
    "producer_config",
    "service_connection",
]

# Where the brokers are and how to reach them: ``bootstrap.servers`` and the security and
# pass-through properties of calmq.kafka.connection_config (or a bare bootstrap string, the
# plaintext local stack).
Connection = str | Mapping[str, Any]

log = logging.getLogger(__name__)


# Batch codecs librdkafka writes. The default is one every mainstream client decodes without
# a plugin: kafkajs, for one, reads gzip natively but throws on lz4, snappy and zstd batches
# until a codec package is registered, and calmq.results is read by other teams' clients.
COMPRESSIONS = ("none", "gzip", "snappy", "lz4", "zstd")
# none rather than gzip: measured on the relay (docs/reference/topics.md), gzip cost a quarter
# of the drain rate and ten times the commit-to-ack latency; calmq's Avro events are small.
DEFAULT_COMPRESSION = "none"


def _base(connection: Connection) -> dict[str, Any]:
    if isinstance(connection, str):
        return {"bootstrap.servers": connection}
    return dict(connection)


def connection_config(settings: Settings) -> dict[str, Any]:
    """The librdkafka properties every client of this process shares: the bootstrap
    servers, the security settings and ``kafka_config``'s pass-through.

    Raises ConfigError naming the setting when the security settings do not fit together
    (a SASL protocol without a mechanism, SCRAM without a password, ...) and when a
    pass-through property is not one librdkafka knows (librdkafka itself is asked).
    """
    s = settings
    config: dict[str, Any] = {"bootstrap.servers": s.kafka_bootstrap}
    protocol = s.kafka_security_protocol
    sasl = protocol.startswith("SASL_")
    if s.kafka_sasl_mechanism and not sasl:
        raise ConfigError(
            f"CALMQ_KAFKA_SASL_MECHANISM={s.kafka_sasl_mechanism} needs a SASL protocol: set "
            "CALMQ_KAFKA_SECURITY_PROTOCOL=SASL_SSL (or SASL_PLAINTEXT)",
            code="kafka_security_settings")
    if protocol != "PLAINTEXT":
        config["security.protocol"] = protocol
    if sasl:
        config.update(_sasl(s))
    if protocol in ("SSL", "SASL_SSL"):
        for setting, prop in (("kafka_ssl_ca_location", "ssl.ca.location"),
                              ("kafka_ssl_certificate_location", "ssl.certificate.location"),
                              ("kafka_ssl_key_location", "ssl.key.location")):
            if getattr(s, setting):
                config[prop] = getattr(s, setting)
        if s.kafka_ssl_key_password.get_secret_value():
            config["ssl.key.password"] = s.kafka_ssl_key_password.get_secret_value()
        if bool(s.kafka_ssl_certificate_location) != bool(s.kafka_ssl_key_location):
            raise ConfigError(
                "mTLS needs both CALMQ_KAFKA_SSL_CERTIFICATE_LOCATION and "
                "CALMQ_KAFKA_SSL_KEY_LOCATION", code="kafka_security_settings")
    else:
        stray = [n for n in ("kafka_ssl_ca_location", "kafka_ssl_certificate_location",
                             "kafka_ssl_key_location") if getattr(s, n)]
        if stray:
            raise ConfigError(
                f"{', '.join('CALMQ_' + n.upper() for n in stray)} set, but "
                f"CALMQ_KAFKA_SECURITY_PROTOCOL={protocol} uses no TLS: set SSL or SASL_SSL",
                code="kafka_security_settings")
    extra = s.kafka_properties
    if extra:
        check_properties(extra)
        config.update(extra)
    return config


def _sasl(s: Settings) -> dict[str, Any]:
    mechanism = s.kafka_sasl_mechanism
    if not mechanism:
        raise ConfigError(
            f"CALMQ_KAFKA_SECURITY_PROTOCOL={s.kafka_security_protocol} needs "
            "CALMQ_KAFKA_SASL_MECHANISM (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512 or OAUTHBEARER)",
            code="kafka_security_settings")
    config: dict[str, Any] = {"sasl.mechanism": mechanism}
    if mechanism in ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"):
        missing = [n for n, v in (("CALMQ_KAFKA_SASL_USERNAME", s.kafka_sasl_username),
                                  ("CALMQ_KAFKA_SASL_PASSWORD",
                                   s.kafka_sasl_password.get_secret_value())) if not v]
        if missing:
            raise ConfigError(f"SASL {mechanism} needs {' and '.join(missing)} (or "
                              f"{missing[0]}_FILE)", code="kafka_credentials_missing")
        config["sasl.username"] = s.kafka_sasl_username
        config["sasl.password"] = s.kafka_sasl_password.get_secret_value()
        return config
    # OAUTHBEARER
    if s.kafka_sasl_oauthbearer_extensions:
        config["sasl.oauthbearer.extensions"] = s.kafka_sasl_oauthbearer_extensions
    if s.kafka_sasl_oauthbearer_method == "aws_msk_iam":
        config["oauth_cb"] = _msk_iam_token(s.kafka_sasl_oauthbearer_aws_region)
        return config
    missing = [n for n, v in (
        ("CALMQ_KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL",
         s.kafka_sasl_oauthbearer_token_endpoint_url),
        ("CALMQ_KAFKA_SASL_OAUTHBEARER_CLIENT_ID", s.kafka_sasl_oauthbearer_client_id),
        ("CALMQ_KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET",
         s.kafka_sasl_oauthbearer_client_secret.get_secret_value())) if not v]
    if missing:
        raise ConfigError(f"SASL OAUTHBEARER (oidc) needs {', '.join(missing)}",
                          code="kafka_credentials_missing")
    config.update({
        "sasl.oauthbearer.method": "oidc",
        "sasl.oauthbearer.token.endpoint.url": s.kafka_sasl_oauthbearer_token_endpoint_url,
        "sasl.oauthbearer.client.id": s.kafka_sasl_oauthbearer_client_id,
        "sasl.oauthbearer.client.secret":
            s.kafka_sasl_oauthbearer_client_secret.get_secret_value(),
    })
    if s.kafka_sasl_oauthbearer_scope:
        config["sasl.oauthbearer.scope"] = s.kafka_sasl_oauthbearer_scope
    return config


def _msk_iam_token(region: str) -> Callable[[str], tuple[str, float]]:
    """librdkafka's ``oauth_cb`` for MSK IAM: a token signed (SigV4) with the credentials
    the AWS SDK finds (IRSA / pod identity, instance profile, environment), by AWS's own
    signer library. librdkafka calls it again before the token expires."""
    try:
        from aws_msk_iam_sasl_signer import MSKAuthTokenProvider  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        raise ConfigError(
            "CALMQ_KAFKA_SASL_OAUTHBEARER_METHOD=aws_msk_iam needs AWS's signer: "
            "pip install 'calmq[msk-iam]' (aws-msk-iam-sasl-signer-python)",
            code="kafka_security_settings") from None
    if not region:
        import boto3

        region = boto3.session.Session().region_name or ""
    if not region:
        raise ConfigError("aws_msk_iam needs the cluster's region: set "
                          "CALMQ_KAFKA_SASL_OAUTHBEARER_AWS_REGION (or AWS_REGION)",
                          code="kafka_security_settings")

    def token(_config: str) -> tuple[str, float]:
        value, expiry_ms = MSKAuthTokenProvider.generate_auth_token(region)
        return str(value), float(expiry_ms) / 1000

    return token


def check_properties(props: Mapping[str, Any]) -> None:
    """Ask librdkafka whether it knows every property (and can read its value): a client
    is made with them and no brokers, so it connects nowhere, then closed. A wrong name is
    a ConfigError naming it, at start-up rather than as a silently ignored setting."""
    quiet = logging.getLogger("calmq.kafka.check")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    try:
        probe = Producer({**props, "logger": quiet})
    except KafkaException as exc:
        error = exc.args[0] if exc.args else exc
        text = error.str() if isinstance(error, KafkaError) else str(error)
        raise ConfigError(f"CALMQ_KAFKA_CONFIG: {text} (librdkafka's properties: "
                          "CONFIGURATION.md of librdkafka)", code="unknown_kafka_property"
                          ) from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"CALMQ_KAFKA_CONFIG: {exc}", code="unknown_kafka_property") from None
    probe.flush(0)
    del probe


class _Recorder(logging.Handler):
    """librdkafka's log lines of one probe client: they carry the reason a connection
    failed (the error codes alone say only "transport failure")."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []
        self._lock = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        with self._lock:
            self.lines.append(record.getMessage())

    def snapshot(self) -> list[str]:
        with self._lock:
            return list(self.lines)


def _diagnose(config: Mapping[str, Any], lines: Sequence[str]) -> ConfigError | None:
    """A configuration mistake the broker's answers show, naming the setting to change;
    None when nothing says so (the brokers may just be away)."""
    protocol = str(config.get("security.protocol", "PLAINTEXT")).upper()
    address = config.get("bootstrap.servers", "?")
    for line in lines:
        if "certificate verify failed" in line or ("SSL handshake failed" in line
                                                   and "certificate" in line):
            return ConfigError(
                f"Kafka at {address}: the broker's TLS certificate is not trusted: set "
                "CALMQ_KAFKA_SSL_CA_LOCATION to the PEM file of the CA that signed it "
                f"({_reason(line)})", code="kafka_tls_untrusted")
        if "SASL authentication error" in line or "Authentication failed" in line:
            return ConfigError(
                f"Kafka at {address} refused the credentials: check "
                "CALMQ_KAFKA_SASL_USERNAME and CALMQ_KAFKA_SASL_PASSWORD (and "
                f"CALMQ_KAFKA_SASL_MECHANISM) ({_reason(line)})",
                code="kafka_authentication_failed")
        if "Unsupported SASL mechanism" in line:
            return ConfigError(
                f"Kafka at {address}: {_reason(line)}: set CALMQ_KAFKA_SASL_MECHANISM "
                "to one the broker supports", code="kafka_sasl_mechanism_unsupported")
        if "APIVERSION_QUERY" in line and "closed" in line and "SSL" not in protocol:
            return ConfigError(
                f"Kafka at {address} closed the connection at the first request: its "
                f"listener expects TLS, not {protocol}: set CALMQ_KAFKA_SECURITY_PROTOCOL "
                "(SASL_SSL with CALMQ_KAFKA_SASL_MECHANISM, CALMQ_KAFKA_SASL_USERNAME and "
                "CALMQ_KAFKA_SASL_PASSWORD, or SSL)", code="kafka_security_mismatch")
        if protocol == "SSL" and "SSL connection closed by peer" in line \
                and "state UP" in line:
            return ConfigError(
                f"Kafka at {address} closed the TLS connection before any answer: its "
                "listener expects SASL: set CALMQ_KAFKA_SECURITY_PROTOCOL=SASL_SSL with "
                "CALMQ_KAFKA_SASL_MECHANISM, CALMQ_KAFKA_SASL_USERNAME and "
                "CALMQ_KAFKA_SASL_PASSWORD", code="kafka_security_mismatch")
    return None


def _reason(line: str) -> str:
    # "FAIL [rdkafka#producer-1] [thrd:...]: host:port/bootstrap: <reason> (after 5ms ...)"
    text = line.rsplit("/bootstrap: ", 1)[-1].rsplit("]: ", 1)[-1]
    return text.split(" (after ")[0].strip()


def check_connection(connection: Connection, timeout: float = 10.0, *,
                     hint: str = "check CALMQ_KAFKA_BOOTSTRAP") -> Any:
    """The cluster's metadata, fetched with this process's client settings.

    A refusal that only a configuration change cures (a TLS listener spoken to in
    plaintext, an untrusted certificate, wrong or missing SASL credentials) raises a
    ConfigError at once, naming the setting, instead of the clients retrying it forever.
    Brokers that do not answer at all raise InfrastructureError (``kafka_unreachable``).
    """
    import time

    config = _base(connection)
    recorder = _Recorder()
    logger = logging.getLogger(f"calmq.kafka.probe.{id(recorder)}")
    logger.addHandler(recorder)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    probe: dict[str, Any] = {**config, "logger": logger,
                             "socket.connection.setup.timeout.ms": int(max(1.0, timeout) * 1000)}
    admin = AdminClient(probe)
    deadline = time.monotonic() + timeout
    last: BaseException | None = None
    try:
        while True:
            try:
                return admin.list_topics(timeout=min(1.0, max(0.1, deadline - time.monotonic())))
            except KafkaException as exc:
                last = exc
            admin.poll(0)  # log lines reach the logger only when the client is polled
            diagnosis = _diagnose(config, recorder.snapshot())
            if diagnosis is not None:
                raise diagnosis
            if time.monotonic() >= deadline:
                break
    finally:
        logger.removeHandler(recorder)
    seen = [_reason(line) for line in recorder.snapshot() if "FAIL" in line]
    error = last.args[0] if last is not None and last.args else last
    reason = seen[-1] if seen else (error.str() if isinstance(error, KafkaError) else str(error))
    raise InfrastructureError(
        f"Kafka at {config.get('bootstrap.servers')} is not reachable ({reason}): {hint}",
        code="kafka_unreachable")


def service_connection(settings: Settings, *, timeout: float = 10.0) -> dict[str, Any]:
    """A service's client settings, checked once against the cluster at start-up.

    A configuration the brokers refuse (wrong protocol, untrusted CA, bad credentials)
    raises ConfigError naming the setting, so the process exits with one clear line
    instead of retrying a handshake that can never succeed. Brokers that do not answer
    yet are only logged: the clients wait for them, as they always did.
    """
    config = connection_config(settings)
    try:
        check_connection(config, timeout)
    except InfrastructureError as exc:
        log.warning("%s; starting anyway, the Kafka clients retry", exc.message)
    return config


def producer_config(
    connection: Connection, *, compression: str = DEFAULT_COMPRESSION, **extra: Any
) -> dict[str, Any]:
    """An idempotent producer: retries never duplicate or reorder within a partition.

    ``murmur2_random`` is the Java client's partitioner (and so Kafka Connect's, Debezium's
    and Kafka Streams'): murmur2 of the key, positive, modulo the partition count. librdkafka's
    default (``consistent_random``, CRC32) sends most keys elsewhere, so one job's events
    published by calmq and by a Java producer (the Debezium connector standing in for the
    relay, an upstream service) would land in different partitions and lose per-job order.
    Records without a key go to a random partition, as with the Java client.
    """
    if compression not in COMPRESSIONS:
        raise ValueError(f"compression {compression!r} is not one of {', '.join(COMPRESSIONS)}")
    return {
        **_base(connection),
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 2,
        "partitioner": "murmur2_random",
        "compression.type": compression,
        "batch.num.messages": 10000,
        "queue.buffering.max.messages": 500000,
        **extra,
    }


# What consumer_config adds to the connection: a group's own settings, which a client
# reading beside the group (an admin client, the lag readers) must not take over.
CONSUMER_KEYS = frozenset({
    "group.id", "enable.auto.commit", "enable.auto.offset.store", "auto.offset.reset",
    "partition.assignment.strategy", "session.timeout.ms", "heartbeat.interval.ms",
    "max.poll.interval.ms", "fetch.wait.max.ms", "on_commit",
})


def connection_of(config: Mapping[str, Any]) -> dict[str, Any]:
    """A consumer configuration less the group's own settings: the connection (bootstrap,
    security, pass-through, callbacks such as ``oauth_cb``) for a client beside it."""
    return {k: v for k, v in config.items() if k not in CONSUMER_KEYS}


def consumer_config(connection: Connection, group: str, **extra: Any) -> dict[str, Any]:
    """Manual commits only: an offset is committed after its job's outcome is durable."""
    return {
        **_base(connection),
        "group.id": group,
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "earliest",
        "partition.assignment.strategy": "cooperative-sticky",
        "session.timeout.ms": 10000,
        "heartbeat.interval.ms": 1000,
        "max.poll.interval.ms": 300000,
        # How long the broker parks an empty fetch. It answers as soon as a record arrives
        # (fetch.min.bytes is 1), so a longer park does not delay a job; it only sets how
        # often an idle consumer asks again. At 10 ms the idle stack's broker used a quarter
        # of a core answering empty fetches (5 % at 500, the Java client's default): CPU the
        # attempts of a latency-bound lane shared two cores with (BENCHMARKS.md).
        "fetch.wait.max.ms": 500,
        **extra,
    }


def create_topics(
    connection: Connection, names: Iterable[str], *, partitions: int, replication: int = 1,
    min_insync_replicas: int | None = None, max_message_bytes: int | None = None,
) -> list[str]:
    """Create the topics that do not exist yet; returns the ones created now.

    ``min_insync_replicas``: the topics' ``min.insync.replicas`` (None: the broker's).
    ``max_message_bytes``: the topics' ``max.message.bytes``, the same number as the relay
    producer's ``message.max.bytes`` (setting kafka_max_message_bytes), so a record the
    relay may send is one every topic takes (None: the broker's default)."""
    config = _base(connection)
    admin = AdminClient(config)
    try:
        existing = set(admin.list_topics(timeout=15).topics)
    except KafkaException as exc:
        raise InfrastructureError(
            f"cannot reach Kafka at {config['bootstrap.servers']}: {exc}") from exc
    wanted = [n for n in dict.fromkeys(names) if n not in existing]
    if not wanted:
        return []
    topic_config = ({} if max_message_bytes is None
                    else {"max.message.bytes": str(max_message_bytes)})
    if min_insync_replicas:
        topic_config["min.insync.replicas"] = str(min_insync_replicas)
    futures = admin.create_topics(
        [NewTopic(n, num_partitions=partitions, replication_factor=replication,
                  config=topic_config) for n in wanted],
        operation_timeout=30,
    )
    created = []
    for name, future in futures.items():
        try:
            future.result()
            created.append(name)
        except KafkaException as exc:
            if "TOPIC_ALREADY_EXISTS" not in str(exc):
                raise InfrastructureError(f"cannot create topic {name}: {exc}") from exc
    return created


def produce(
    producer: Producer,
    topic: str,
    key: bytes | None,
    value: bytes | None,
    *,
    headers: list[tuple[str, str | bytes | None]],
    on_delivery: Callable[[KafkaError | None, Message], None],
) -> None:
    """Produce one record; when the local queue is full, serve delivery reports and retry.

    Blocking here is the back pressure the relay and the forwarder want: neither may drop a
    record, and both confirm their source only after its delivery report.
    """
    while True:
        try:
            producer.produce(topic, value=value, key=key, headers=headers,
                             on_delivery=on_delivery)
            return
        except BufferError:
            producer.poll(0.05)


def header(headers: Sequence[tuple[str, bytes | None]] | None, name: str) -> str | None:
    for key, value in headers or ():
        if key == name and value is not None:
            return value.decode("utf-8", "replace")
    return None


def headers_dict(headers: Sequence[tuple[str, bytes | None]] | None) -> dict[str, str]:
    return {k: v.decode("utf-8", "replace") for k, v in headers or () if v is not None}
