"""Client settings for secured clusters: Kafka security, pass-through, registry auth, *_FILE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from calmq.codec import registry_config
from calmq.errors import ConfigError
from calmq.kafka import connection_config, consumer_config, producer_config
from calmq.lag import client_config
from calmq.settings import Settings

SCRAM = {
    "CALMQ_KAFKA_BOOTSTRAP": "b-1.example:9096",
    "CALMQ_KAFKA_SECURITY_PROTOCOL": "SASL_SSL",
    "CALMQ_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
    "CALMQ_KAFKA_SASL_USERNAME": "calmq",
    "CALMQ_KAFKA_SASL_PASSWORD": "s3cret",
    "CALMQ_KAFKA_SSL_CA_LOCATION": "/etc/calmq/ca.pem",
}


def _settings(**env: str) -> Settings:
    return Settings.load(environ=env)


def test_sasl_ssl_scram_settings_become_librdkafka_properties_of_every_client() -> None:
    """The six usual properties reach the producer and consumer configurations alike."""
    connection = connection_config(_settings(**SCRAM))
    expected = {"bootstrap.servers": "b-1.example:9096", "security.protocol": "SASL_SSL",
                "sasl.mechanism": "SCRAM-SHA-512", "sasl.username": "calmq",
                "sasl.password": "s3cret", "ssl.ca.location": "/etc/calmq/ca.pem"}
    assert connection == expected
    producer = producer_config(connection)
    consumer = consumer_config(connection, "calmq.default")
    assert expected.items() <= producer.items()
    assert expected.items() <= consumer.items()
    assert producer["acks"] == "all"
    assert producer["enable.idempotence"] is True


def test_lower_case_protocol_and_mechanism_are_read_as_librdkafka_reads_them() -> None:
    """sasl_ssl and scram-sha-256 are accepted and normalised."""
    s = _settings(**{**SCRAM, "CALMQ_KAFKA_SECURITY_PROTOCOL": "sasl_ssl",
                     "CALMQ_KAFKA_SASL_MECHANISM": "scram-sha-256"})
    assert connection_config(s)["sasl.mechanism"] == "SCRAM-SHA-256"


@pytest.mark.parametrize(("change", "named"), [
    ({"CALMQ_KAFKA_SASL_MECHANISM": ""}, "CALMQ_KAFKA_SASL_MECHANISM"),
    ({"CALMQ_KAFKA_SASL_PASSWORD": ""}, "CALMQ_KAFKA_SASL_PASSWORD"),
    ({"CALMQ_KAFKA_SASL_USERNAME": ""}, "CALMQ_KAFKA_SASL_USERNAME"),
    ({"CALMQ_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT"}, "CALMQ_KAFKA_SECURITY_PROTOCOL"),
    ({"CALMQ_KAFKA_SASL_MECHANISM": "OAUTHBEARER"},
     "CALMQ_KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL"),
])
def test_incomplete_security_settings_are_an_error_naming_the_setting(
        change: dict[str, str], named: str) -> None:
    """A missing credential or a mechanism without SASL names the setting to set."""
    with pytest.raises(ConfigError, match=named):
        connection_config(_settings(**{**SCRAM, **change}))


def test_oauthbearer_oidc_uses_librdkafkas_client_credentials_grant() -> None:
    """OIDC settings map to sasl.oauthbearer.* with method oidc."""
    s = _settings(**{**SCRAM, "CALMQ_KAFKA_SASL_MECHANISM": "OAUTHBEARER",
                     "CALMQ_KAFKA_SASL_PASSWORD": "", "CALMQ_KAFKA_SASL_USERNAME": "",
                     "CALMQ_KAFKA_SASL_OAUTHBEARER_TOKEN_ENDPOINT_URL": "https://idp/token",
                     "CALMQ_KAFKA_SASL_OAUTHBEARER_CLIENT_ID": "calmq",
                     "CALMQ_KAFKA_SASL_OAUTHBEARER_CLIENT_SECRET": "x",
                     "CALMQ_KAFKA_SASL_OAUTHBEARER_EXTENSIONS": "logicalCluster=lkc-1"})
    config = connection_config(s)
    assert config["sasl.oauthbearer.method"] == "oidc"
    assert config["sasl.oauthbearer.token.endpoint.url"] == "https://idp/token"
    assert config["sasl.oauthbearer.client.secret"] == "x"
    assert config["sasl.oauthbearer.extensions"] == "logicalCluster=lkc-1"
    assert "sasl.username" not in config


def test_msk_iam_gives_librdkafka_a_token_callback_signed_by_aws(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """aws_msk_iam: an oauth_cb that returns AWS's signed token and its expiry in seconds."""
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "example")
    s = _settings(**{**SCRAM, "CALMQ_KAFKA_SASL_MECHANISM": "OAUTHBEARER",
                     "CALMQ_KAFKA_SASL_PASSWORD": "", "CALMQ_KAFKA_SASL_USERNAME": "",
                     "CALMQ_KAFKA_SASL_OAUTHBEARER_METHOD": "aws_msk_iam",
                     "CALMQ_KAFKA_SASL_OAUTHBEARER_AWS_REGION": "eu-west-1"})
    config = connection_config(s)
    token, expiry = config["oauth_cb"]("")
    assert len(token) > 100
    assert "=" not in token
    assert expiry > 1e9  # seconds since the epoch, as librdkafka wants
    # The lag readers and admin clients beside a consumer get the callback too.
    assert client_config(consumer_config(config, "g"))["oauth_cb"] is config["oauth_cb"]


def test_pass_through_properties_reach_every_client_in_json_or_properties_text() -> None:
    """CALMQ_KAFKA_CONFIG as JSON or key=value lines is merged into the connection."""
    as_json = _settings(CALMQ_KAFKA_BOOTSTRAP="k:9092",
                        CALMQ_KAFKA_CONFIG='{"client.dns.lookup": "use_all_dns_ips",'
                                           ' "socket.keepalive.enable": true}')
    as_text = _settings(CALMQ_KAFKA_BOOTSTRAP="k:9092",
                        CALMQ_KAFKA_CONFIG="# Azure needs this\nconnections.max.idle.ms=180000\n"
                                           "client.dns.lookup = use_all_dns_ips\n")
    assert connection_config(as_json)["socket.keepalive.enable"] is True
    assert connection_config(as_text)["connections.max.idle.ms"] == "180000"
    assert connection_config(as_text)["client.dns.lookup"] == "use_all_dns_ips"


def test_a_pass_through_name_librdkafka_does_not_know_is_a_config_error_naming_it() -> None:
    """librdkafka itself checks each name at start-up; the error names the wrong one."""
    s = _settings(CALMQ_KAFKA_BOOTSTRAP="k:9092",
                  CALMQ_KAFKA_CONFIG='{"socket.keepalive.enabled": true}')
    with pytest.raises(ConfigError, match=r"socket\.keepalive\.enabled") as raised:
        connection_config(s)
    assert raised.value.code == "unknown_kafka_property"


@pytest.mark.parametrize(("text", "named"), [
    ('{"sasl.password": "x"}', "CALMQ_KAFKA_SASL_PASSWORD"),
    ("acks=1", "acks"),
    ("enable.auto.commit=true", "enable.auto.commit"),
    ("not a property line", "line 1"),
])
def test_pass_through_refuses_what_calmq_sets_itself(text: str, named: str) -> None:
    """Properties with a setting of their own, or that calmq's guarantees rest on, are refused."""
    with pytest.raises(ConfigError, match=named):
        _settings(CALMQ_KAFKA_CONFIG=text)


def test_a_secret_is_read_from_a_file_named_by_the_file_variable(tmp_path: Path) -> None:
    """CALMQ_KAFKA_SASL_PASSWORD_FILE reads the password, less the final newline."""
    secret = tmp_path / "password"
    secret.write_text("from-a-secret-volume\n")
    s = _settings(CALMQ_KAFKA_SASL_PASSWORD_FILE=str(secret))
    assert s.kafka_sasl_password.get_secret_value() == "from-a-secret-volume"
    assert "from-a-secret-volume" not in repr(s)


def test_file_variables_are_checked_like_the_settings_they_name(tmp_path: Path) -> None:
    """Both forms at once, an unreadable file and an unknown *_FILE name are errors."""
    secret = tmp_path / "password"
    secret.write_text("x")
    with pytest.raises(ConfigError, match="CALMQ_KAFKA_SASL_PASSWORD_FILE") as both:
        _settings(CALMQ_KAFKA_SASL_PASSWORD="y", CALMQ_KAFKA_SASL_PASSWORD_FILE=str(secret))
    assert both.value.code == "conflicting_setting"
    with pytest.raises(ConfigError, match="cannot read") as missing:
        _settings(CALMQ_SCHEMA_REGISTRY_PASSWORD_FILE=str(tmp_path / "nothing"))
    assert missing.value.code == "unreadable_setting_file"
    with pytest.raises(ConfigError, match="CALMQ_KAFKA_PASWORD_FILE"):
        _settings(CALMQ_KAFKA_PASWORD_FILE=str(secret))


def test_registry_basic_auth_bearer_token_and_ca_map_to_the_registry_client() -> None:
    """Basic auth, a bearer token and TLS settings use confluent_kafka's registry names."""
    basic = registry_config(_settings(CALMQ_SCHEMA_REGISTRY_USERNAME="key",
                                      CALMQ_SCHEMA_REGISTRY_PASSWORD="secret",
                                      CALMQ_SCHEMA_REGISTRY_CA_LOCATION="/ca.pem"))
    assert basic == {"basic.auth.user.info": "key:secret", "ssl.ca.location": "/ca.pem"}
    bearer = registry_config(_settings(CALMQ_SCHEMA_REGISTRY_BEARER_TOKEN="tok"))
    assert bearer["bearer.auth.credentials.source"] == "STATIC_TOKEN"
    assert bearer["bearer.auth.token"] == "tok"
    with pytest.raises(ConfigError, match="CALMQ_SCHEMA_REGISTRY_PASSWORD"):
        registry_config(_settings(CALMQ_SCHEMA_REGISTRY_USERNAME="key"))
    with pytest.raises(ConfigError, match="not both"):
        registry_config(_settings(CALMQ_SCHEMA_REGISTRY_USERNAME="key",
                                  CALMQ_SCHEMA_REGISTRY_PASSWORD="secret",
                                  CALMQ_SCHEMA_REGISTRY_BEARER_TOKEN="tok"))


def test_registry_oauth_properties_pass_through_to_the_registry_client() -> None:
    """CALMQ_SCHEMA_REGISTRY_CONFIG's bearer.auth.* keys reach the registry client's config."""
    from confluent_kafka.schema_registry import SchemaRegistryClient

    oauth = {"bearer.auth.credentials.source": "OAUTHBEARER",
             "bearer.auth.client.id": "calmq", "bearer.auth.client.secret": "s3cret",
             "bearer.auth.scope": "registry",
             "bearer.auth.issuer.endpoint.url": "https://idp.example/oauth2/token",
             "bearer.auth.logical.cluster": "lsrc-1", "bearer.auth.identity.pool.id": "pool-1"}
    as_lines = "\n".join(f"{k}={v}" for k, v in oauth.items())
    for text in (as_lines, json.dumps(oauth)):
        config = registry_config(_settings(CALMQ_SCHEMA_REGISTRY_CONFIG=text))
        assert config == oauth
    # The client takes them as they are: OAuth from the identity provider, not a static token.
    client = SchemaRegistryClient({**config, "url": "https://registry.example"})
    assert client._rest_client.bearer_auth_credentials_source == "OAUTHBEARER"


@pytest.mark.parametrize(("env", "named"), [
    ({"CALMQ_SCHEMA_REGISTRY_CONFIG": "basic.auth.user.info=a:b"},
     "CALMQ_SCHEMA_REGISTRY_USERNAME"),
    ({"CALMQ_SCHEMA_REGISTRY_CONFIG": "url=https://elsewhere"}, "CALMQ_SCHEMA_REGISTRY_URL"),
    ({"CALMQ_SCHEMA_REGISTRY_CONFIG": "not a property"}, "not key=value"),
])
def test_registry_pass_through_refuses_what_has_a_setting(env: dict[str, str],
                                                          named: str) -> None:
    """A registry property with a setting of its own is refused, naming that setting."""
    with pytest.raises(ConfigError, match=named):
        _settings(**env)


def test_registry_oauth_and_a_static_token_together_are_refused() -> None:
    """OAuth through the pass-through and CALMQ_SCHEMA_REGISTRY_BEARER_TOKEN conflict."""
    with pytest.raises(ConfigError, match="CALMQ_SCHEMA_REGISTRY_BEARER_TOKEN"):
        registry_config(_settings(
            CALMQ_SCHEMA_REGISTRY_BEARER_TOKEN="tok",
            CALMQ_SCHEMA_REGISTRY_CONFIG="bearer.auth.credentials.source=OAUTHBEARER"))
