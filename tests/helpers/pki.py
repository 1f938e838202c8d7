"""A throwaway PKI for the embedding service's TLS tests: two CAs and leaf certificates as PEM files."""

from __future__ import annotations

import datetime
import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

#: The name ``PKI.named_cert`` holds, as a deployment's ``embedding.tls_server_name`` would give it.
SERVER_NAME = "embedding.internal"

Key = ec.EllipticCurvePrivateKey


@dataclass(frozen=True)
class PKI:
    """PEM files: ``ca`` signed ``cert`` (SAN localhost, 127.0.0.1) and ``named_cert`` (SAN embedding.internal
    only); ``other_ca`` signed ``other_cert``. Leaf certificates allow server and client use."""

    ca: Path
    cert: Path
    key: Path
    named_cert: Path
    named_key: Path
    other_ca: Path
    other_cert: Path
    other_key: Path


def make_pki(directory: Path) -> PKI:
    """Fresh keys and certificates (valid from an hour ago for a day) written to ``directory``."""
    ca, ca_name, ca_key = _authority(directory, "ca")
    other_ca, other_name, other_key = _authority(directory, "other-ca")
    loopback = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    cert, key = _leaf(directory, "server", ca_name, ca_key, loopback)
    named_cert, named_key = _leaf(directory, "named", ca_name, ca_key, [x509.DNSName(SERVER_NAME)])
    stranger_cert, stranger_key = _leaf(directory, "stranger", other_name, other_key, loopback)
    return PKI(ca, cert, key, named_cert, named_key, other_ca, stranger_cert, stranger_key)


def trusting(ca: Path, cert: Path | None = None, key: Path | None = None) -> grpc.ChannelCredentials:
    """Client credentials trusting ``ca``, presenting ``cert`` (with ``key``) when given."""
    client_key = None if key is None else key.read_bytes()
    return grpc.ssl_channel_credentials(ca.read_bytes(), client_key, None if cert is None else cert.read_bytes())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _certificate(subject: str, key: Key, issuer: x509.Name, issuer_key: Key, *, ca: bool,
                 names: Sequence[x509.GeneralName] = ()) -> x509.Certificate:
    now = datetime.datetime.now(datetime.timezone.utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if not ca:
        builder = builder.add_extension(x509.SubjectAlternativeName(list(names)), critical=False)
        usages = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
        builder = builder.add_extension(x509.ExtendedKeyUsage(usages), critical=False)
    return builder.sign(issuer_key, hashes.SHA256())


def _write_certificate(directory: Path, name: str, certificate: x509.Certificate) -> Path:
    path = directory / f"{name}.pem"
    path.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return path


def _write_key(directory: Path, name: str, key: Key) -> Path:
    path = directory / f"{name}.key"
    path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return path


def _authority(directory: Path, name: str) -> tuple[Path, x509.Name, Key]:
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = _certificate(name, key, _name(name), key, ca=True)
    return _write_certificate(directory, name, certificate), certificate.subject, key


def _leaf(directory: Path, name: str, issuer: x509.Name, issuer_key: Key,
          names: Sequence[x509.GeneralName]) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    certificate = _certificate(name, key, issuer, issuer_key, ca=False, names=names)
    return _write_certificate(directory, name, certificate), _write_key(directory, name, key)
