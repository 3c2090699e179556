"""Reading librdkafka's connection failures into the setting to change, and the dev stack's
certificates and registry proxy check.

The log lines are librdkafka 2.16's own, recorded against the secured dev stack's broker
(SASL_SSL only, SCRAM-SHA-512, its own CA); tests/integration/test_secured_stack.py
checks the same errors against the live broker.
"""

from __future__ import annotations

import base64
import ssl
from pathlib import Path

import pytest

from calmq.kafka import _diagnose, check_connection
from calmq.tooling.devstack.registry_proxy import _allowed
from calmq.tooling.devstack.tls import make_authority

B = "127.0.0.1:50265"
LINES = {
    "plaintext": f"FAIL [rdkafka#producer-1] [thrd:{B}/bootstrap]: {B}/bootstrap: Disconnected:"
                 " connection closed by peer: receive 0 after POLLIN (after 5ms in state"
                 " APIVERSION_QUERY)",
    "untrusted": f"FAIL [rdkafka#producer-2] [thrd:ssl://{B}/bootstrap]: ssl://{B}/bootstrap:"
                 " SSL handshake failed: error:0A000086:SSL routines::certificate verify"
                 " failed: broker certificate could not be verified, verify that"
                 " ssl.ca.location is correctly configured (after 3ms in state SSL_HANDSHAKE)",
    "ssl_only": f"FAIL [rdkafka#producer-3] [thrd:ssl://{B}/bootstrap]: ssl://{B}/bootstrap:"
                " Disconnected: SSL connection closed by peer (after 4ms in state UP)",
    "password": f"FAIL [rdkafka#producer-5] [thrd:sasl_ssl://{B}/bootstrap]:"
                f" sasl_ssl://{B}/bootstrap: SASL authentication error: Authentication failed"
                " during authentication due to invalid credentials with SASL mechanism"
                " SCRAM-SHA-512 (after 354ms in state AUTH_REQ)",
    "mechanism": f"FAIL [rdkafka#producer-6] [thrd:sasl_ssl://{B}/bootstrap]:"
                 f" sasl_ssl://{B}/bootstrap: SASL SCRAM-SHA-256 mechanism handshake failed:"
                 " Broker: Unsupported SASL mechanism: broker's supported mechanisms:"
                 " SCRAM-SHA-512 (after 302ms in state AUTH_HANDSHAKE)",
    "refused": "FAIL [rdkafka#producer-9] [thrd:127.0.0.1:1/bootstrap]: 127.0.0.1:1/bootstrap:"
               " Connect to ipv4#127.0.0.1:1 failed: Connection refused (after 0ms in state"
               " CONNECT)",
}


@pytest.mark.parametrize(("case", "protocol", "code", "named"), [
    ("plaintext", "PLAINTEXT", "kafka_security_mismatch", "CALMQ_KAFKA_SECURITY_PROTOCOL"),
    ("untrusted", "SASL_SSL", "kafka_tls_untrusted", "CALMQ_KAFKA_SSL_CA_LOCATION"),
    ("ssl_only", "SSL", "kafka_security_mismatch", "CALMQ_KAFKA_SASL_MECHANISM"),
    ("password", "SASL_SSL", "kafka_authentication_failed", "CALMQ_KAFKA_SASL_PASSWORD"),
    ("mechanism", "SASL_SSL", "kafka_sasl_mechanism_unsupported", "SCRAM-SHA-512"),
])
def test_a_refusal_only_configuration_cures_names_the_setting(
        case: str, protocol: str, code: str, named: str) -> None:
    """Each handshake failure a setting causes becomes its ConfigError naming the setting."""
    error = _diagnose({"bootstrap.servers": B, "security.protocol": protocol}, [LINES[case]])
    assert error is not None
    assert error.code == code
    assert named in error.message
    assert B in error.message


def test_brokers_that_do_not_answer_are_not_a_configuration_error() -> None:
    """Connection refused is left to the unreachable path (services wait and retry)."""
    assert _diagnose({"bootstrap.servers": "127.0.0.1:1"}, [LINES["refused"]]) is None


def test_no_broker_listening_is_kafka_unreachable_within_the_timeout() -> None:
    """check_connection against a closed port raises kafka_unreachable, not a ConfigError."""
    from calmq.errors import InfrastructureError

    with pytest.raises(InfrastructureError) as raised:
        check_connection("127.0.0.1:1", timeout=1.0)
    assert raised.value.code == "kafka_unreachable"
    assert "Connection refused" in raised.value.message


def test_server_certificates_are_signed_by_the_stacks_ca_for_loopback(tmp_path: Path) -> None:
    """A certificate the CA issues verifies for 127.0.0.1 and localhost against ca.pem."""
    from cryptography import x509

    authority = make_authority(tmp_path)
    cert = authority.issue("kafka")
    leaf = x509.load_pem_x509_certificate(cert.certificate.read_bytes())
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "localhost" in names.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in names.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    ca = x509.load_pem_x509_certificate(authority.ca.read_bytes())
    leaf.verify_directly_issued_by(ca)
    assert oct(cert.key.stat().st_mode & 0o777) == "0o600"
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert.certificate, cert.key)  # the pair the proxy serves


def test_the_registry_proxy_lets_only_its_users_and_tokens_through() -> None:
    """Basic auth with the right password, or a known bearer token; nothing else."""
    users = {"calmq": "s3cret"}

    def basic(user: str, password: str) -> str:
        return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()

    assert _allowed(basic("calmq", "s3cret"), users, [])
    assert not _allowed(basic("calmq", "wrong"), users, [])
    assert not _allowed(basic("other", "s3cret"), users, [])
    assert not _allowed("", users, [])
    assert not _allowed("Basic !!!", users, [])
    assert _allowed("Bearer tok-1", users, ["tok-1"])
    assert not _allowed("Bearer tok-2", users, ["tok-1"])
