"""A certificate authority and server certificates made at start-up, for the secured stack.

The secured dev stack (``calmq dev up --secure``) runs the broker with only a SASL_SSL
listener and the registry behind HTTPS, as clusters in production do. Their certificates
are made here, on every ``up``, with the ``cryptography`` package (no internet, no keytool
dialogue): a CA, and one certificate per server for 127.0.0.1 and localhost, signed by it.
Clients trust ``ca.pem`` (``CALMQ_KAFKA_SSL_CA_LOCATION``, ``CALMQ_SCHEMA_REGISTRY_CA_LOCATION``).
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Authority", "ServerCertificate", "make_authority"]


@dataclass(frozen=True)
class ServerCertificate:
    certificate: Path  # PEM: the server certificate, then the CA's
    key: Path  # PEM, PKCS#8, unencrypted (readable by the server's user only)
    keystore: Path  # PEM: key then chain in one file (Kafka's ssl.keystore.type=PEM)


@dataclass(frozen=True)
class Authority:
    home: Path
    ca: Path  # PEM certificate of the CA: what clients trust

    def issue(self, name: str, *, hosts: tuple[str, ...] = ("127.0.0.1", "localhost")
              ) -> ServerCertificate:
        """A server certificate for ``hosts`` (IPs and DNS names), signed by this CA."""
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

        ca_key = serialization.load_pem_private_key(
            (self.home / "ca.key").read_bytes(), password=None)
        ca_cert = x509.load_pem_x509_certificate(self.ca.read_bytes())
        key = ec.generate_private_key(ec.SECP256R1())
        names: list[x509.GeneralName] = []
        for host in hosts:
            try:
                names.append(x509.IPAddress(ipaddress.ip_address(host)))
            except ValueError:
                names.append(x509.DNSName(host))
        now = datetime.datetime.now(datetime.UTC)
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH,
                                                  ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
        )
        key_pem = key.private_bytes(serialization.Encoding.PEM,
                                    serialization.PrivateFormat.PKCS8,
                                    serialization.NoEncryption())
        chain = cert.public_bytes(serialization.Encoding.PEM) + self.ca.read_bytes()
        out = ServerCertificate(self.home / f"{name}.pem", self.home / f"{name}.key",
                                self.home / f"{name}-keystore.pem")
        _write(out.key, key_pem, private=True)
        _write(out.certificate, chain)
        _write(out.keystore, key_pem + chain, private=True)
        return out


def make_authority(home: Path) -> Authority:
    """A new CA under ``home`` (``ca.pem``, ``ca.key``), valid for 30 days."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    home.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "calmq dev stack CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                     content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False,
                                     encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()),
                       critical=False)
        .sign(key, hashes.SHA256())
    )
    _write(home / "ca.key", key.private_bytes(serialization.Encoding.PEM,
                                              serialization.PrivateFormat.PKCS8,
                                              serialization.NoEncryption()), private=True)
    _write(home / "ca.pem", cert.public_bytes(serialization.Encoding.PEM))
    return Authority(home, home / "ca.pem")


def _write(path: Path, data: bytes, *, private: bool = False) -> None:
    path.write_bytes(data)
    path.chmod(0o600 if private else 0o644)
