"""KEDA's Kafka scaler, as far as it authenticates: what it reads from a TriggerAuthentication
and the trigger's metadata, what it refuses, and what it then connects with.

Modelled on KEDA 2.16's own definitions: the TriggerAuthentication CRD
(apis/keda/v1alpha1/triggerauthentication_types.go), how the operator resolves it
(pkg/scaling/resolver/scale_resolvers.go: ``secretTargetRef`` from the Secret's key, ``env``
from the scale target's container, ``envFrom`` included; ``podIdentity`` aws with
``identityOwner: workload`` takes the role of the workload's ServiceAccount), and the Kafka
scaler's parsing (pkg/scalers/kafka_scaler.go: ``parseKafkaAuthParams``, ``parseTLS``,
``parseSaslParams``, ``parseSaslOAuthParams``), with its error texts. The documented
parameters: https://keda.sh/docs/2.16/scalers/apache-kafka/#authentication-parameters.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["KAFKA_AUTH_PARAMETERS", "TRIGGER_AUTH_SPEC_KEYS", "KafkaAuth", "KedaRefused",
           "check_trigger_authentication", "librdkafka_config", "parse_kafka_auth",
           "resolve_auth_params"]

# TriggerAuthenticationSpec's fields (KEDA 2.16).
TRIGGER_AUTH_SPEC_KEYS = {"podIdentity", "secretTargetRef", "configMapTargetRef", "env",
                          "hashiCorpVault", "azureKeyVault", "gcpSecretManager",
                          "awsSecretManager"}
# The Kafka scaler's authentication parameters (docs: "Authentication Parameters").
KAFKA_AUTH_PARAMETERS = {
    "sasl", "saslTokenProvider", "username", "password", "keytab", "realm", "kerberosConfig",
    "kerberosServiceName", "kerberosDisableFAST", "oauthTokenEndpointUri", "scopes",
    "oauthExtensions", "tls", "ca", "cert", "key", "keyPassword", "awsRoleArn",
    "awsAccessKeyID", "awsSecretAccessKey"}
_PROVIDERS = {"azure-workload", "gcp", "aws", "aws-eks", "none"}


class KedaRefused(Exception):
    """The scaler would not start: KEDA's error text."""


def check_trigger_authentication(ta: Mapping[str, Any]) -> None:
    """A TriggerAuthentication as the CRD admits it, naming Kafka scaler parameters only."""
    assert ta["apiVersion"] == "keda.sh/v1alpha1"
    assert ta["kind"] == "TriggerAuthentication"
    spec = ta["spec"]
    assert spec, "an empty TriggerAuthentication"
    assert set(spec) <= TRIGGER_AUTH_SPEC_KEYS, set(spec) - TRIGGER_AUTH_SPEC_KEYS
    for ref in spec.get("secretTargetRef", []):
        assert set(ref) == {"parameter", "name", "key"}, ref
        assert all(isinstance(v, str) and v for v in ref.values()), ref
    for ref in spec.get("env", []):
        assert {"parameter", "name"} <= set(ref) <= {"parameter", "name", "containerName"}, ref
    parameters = [r["parameter"] for k in ("secretTargetRef", "env") for r in spec.get(k, [])]
    assert set(parameters) <= KAFKA_AUTH_PARAMETERS, set(parameters) - KAFKA_AUTH_PARAMETERS
    assert len(parameters) == len(set(parameters)), parameters  # one source per parameter
    if "podIdentity" in spec:
        identity = spec["podIdentity"]
        assert identity["provider"] in _PROVIDERS
        assert identity.get("identityOwner", "keda") in ("keda", "workload")


def resolve_auth_params(spec: Mapping[str, Any], secrets: Mapping[tuple[str, str], str],
                        container_env: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """The scaler's AuthParams: each ``secretTargetRef`` read from ``secrets`` by (Secret,
    key), each ``env`` from ``container_env`` (the target's containers' resolved variables,
    by container name). A missing Secret key is KEDA's error, not an empty value."""
    params: dict[str, str] = {}
    for ref in spec.get("secretTargetRef", []):
        if (ref["name"], ref["key"]) not in secrets:
            raise KedaRefused(f"error reading secret {ref['name']}/{ref['key']}")
        params[ref["parameter"]] = secrets[(ref["name"], ref["key"])]
    for ref in spec.get("env", []):
        env = container_env[ref.get("containerName") or next(iter(container_env))]
        params[ref["parameter"]] = env.get(ref["name"], "")
    return params


@dataclass
class KafkaAuth:
    """What the scaler connects with."""

    sasl: str = "none"
    token_provider: str = ""
    username: str = ""
    password: str = ""
    oauth_token_endpoint: str = ""
    tls: bool = False
    ca: str = ""
    cert: str = ""
    key: str = ""
    key_password: str = ""
    aws_region: str = ""
    aws_pod_identity: bool = False


def _switch(value: str) -> bool:
    if value == "enable":
        return True
    if value == "disable":
        return False
    raise KedaRefused(f"error incorrect TLS value given, got {value}")


def parse_kafka_auth(metadata: Mapping[str, str], auth: Mapping[str, str],
                     pod_identity: Mapping[str, Any] | None = None) -> KafkaAuth:
    """``parseKafkaAuthParams`` of KEDA 2.16: TLS and SASL from the trigger's metadata or the
    TriggerAuthentication (never both), then each mode's parameters."""
    out = KafkaAuth()
    tls = _switch(metadata["tls"]) if "tls" in metadata else False
    if "tls" in auth:
        if tls:
            raise KedaRefused("unable to set `tls` in both ScaledObject and "
                              "TriggerAuthentication together")
        tls = _switch(auth["tls"].strip())
    if tls:
        if bool(auth.get("cert")) != bool(auth.get("key")):
            raise KedaRefused("key must be provided with cert" if auth.get("cert")
                              else "cert must be provided with key")
        out.tls = True
        out.ca, out.cert, out.key = auth.get("ca", ""), auth.get("cert", ""), auth.get("key", "")
        out.key_password = auth.get("keyPassword", "")
    sasl = metadata.get("sasl", "")
    if "sasl" in auth:
        if sasl:
            raise KedaRefused("unable to set `sasl` in both ScaledObject and "
                              "TriggerAuthentication together")
        sasl = auth["sasl"]
    sasl = sasl.strip()
    if not sasl:
        return out
    if sasl in ("plaintext", "scram_sha256", "scram_sha512"):
        out.username, out.password = _username_password(auth)
    elif sasl == "oauthbearer":
        provider = metadata.get("saslTokenProvider", "")
        if "saslTokenProvider" in auth:
            if provider:
                raise KedaRefused("unable to set `saslTokenProvider` in both ScaledObject and "
                                  "TriggerAuthentication together")
            provider = auth["saslTokenProvider"]
        provider = provider.strip() or "bearer"
        if provider == "bearer":
            out.username, out.password = _username_password(auth)
            if not auth.get("oauthTokenEndpointUri"):
                raise KedaRefused("no oauth token endpoint uri given")
            out.oauth_token_endpoint = auth["oauthTokenEndpointUri"].strip()
            for extension in filter(None, auth.get("oauthExtensions", "").split(",")):
                if len(extension.split("=")) != 2:
                    raise KedaRefused("invalid OAuthBearer extension, must be of format "
                                      "key=value")
        elif provider == "aws_msk_iam":
            if not tls:
                raise KedaRefused("TLS is required for AWS MSK authentication")
            if not metadata.get("awsRegion"):
                raise KedaRefused("no awsRegion given")
            out.aws_region = metadata["awsRegion"]
            identity = pod_identity or {}
            if identity.get("provider") == "aws":
                out.aws_pod_identity = True
            elif not (auth.get("awsRoleArn") or (auth.get("awsAccessKeyID")
                                                 and auth.get("awsSecretAccessKey"))):
                raise KedaRefused("error getting AWS authorization: awsAccessKeyID not found")
        else:
            raise KedaRefused(f"err SASL OAuth token provider {provider} given")
        out.token_provider = provider
    else:  # gssapi needs a keytab and krb5.conf; calmq renders none, none other exists
        raise KedaRefused(f"err SASL mode {sasl} given")
    out.sasl = sasl
    return out


def _username_password(auth: Mapping[str, str]) -> tuple[str, str]:
    if not auth.get("username"):
        raise KedaRefused("no username given")
    if not auth.get("password"):
        raise KedaRefused("no password given")
    return auth["username"].strip(), auth["password"].strip()


_MECHANISMS = {"plaintext": "PLAIN", "scram_sha256": "SCRAM-SHA-256",
               "scram_sha512": "SCRAM-SHA-512"}


def librdkafka_config(bootstrap: str, auth: KafkaAuth) -> dict[str, Any]:
    """The connection KEDA's scaler makes, as librdkafka properties: its SASL mode and
    credentials, and TLS with the CA and client certificate as PEM text (KEDA reads them
    from the Secret, never from a file). Plain SASL and SCRAM only: the mechanisms a test
    broker offers."""
    config: dict[str, Any] = {"bootstrap.servers": bootstrap}
    sasl = auth.sasl != "none"
    config["security.protocol"] = {(True, True): "SASL_SSL", (True, False): "SASL_PLAINTEXT",
                                   (False, True): "SSL", (False, False): "PLAINTEXT"}[
                                       (sasl, auth.tls)]
    if sasl:
        config.update({"sasl.mechanism": _MECHANISMS[auth.sasl],
                       "sasl.username": auth.username, "sasl.password": auth.password})
    if auth.tls:
        for prop, value in (("ssl.ca.pem", auth.ca), ("ssl.certificate.pem", auth.cert),
                            ("ssl.key.pem", auth.key), ("ssl.key.password", auth.key_password)):
            if value:
                config[prop] = value
    return config
