"""``tinker-atropos secrets DIR``: what a deployment's links need, made once: the run's token, a Redis password,
a private CA and one certificate signed by it that every service serves and presents (server and client use,
so the same files give mutual TLS).

The certificate names localhost, 127.0.0.1, ``tinker-atropos`` and any ``--name`` given. Services that advertise
pod or container IPs are reached at addresses no certificate can list in advance: their clients set
``TA_TLS_SERVER_NAME=tinker-atropos`` and check that name instead, which only holders of the CA's key can put
in a certificate.
"""

from __future__ import annotations

import datetime
import ipaddress
import secrets
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from tinker_atropos.security import write_secret

SERVICE_NAME = "tinker-atropos"  # in every certificate: what clients check with TA_TLS_SERVER_NAME
DEFAULT_NAMES = ("localhost", "127.0.0.1", "::1", SERVICE_NAME)
# file name -> what it is; keys, token and password are written 0600, certificates 0644
FILES = {
    "token": "the run's token (TA_TOKEN_FILE)",
    "redis-password": "the Redis password (TA_REDIS_PASSWORD_FILE; Valkey's requirepass)",
    "ca.crt": "the CA certificate (TA_TLS_CA, TA_TLS_CLIENT_CA)",
    "ca.key": "the CA's key: keep it offline, it signs more certificates",
    "tls.crt": "the services' certificate (TA_TLS_CERT)",
    "tls.key": "its key (TA_TLS_KEY)",
}
SECRET_FILES = ("token", "redis-password", "ca.key", "tls.key")


@dataclass(frozen=True)
class Authority:
    certificate: x509.Certificate
    key: ec.EllipticCurvePrivateKey


def _pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _alternative_name(name: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(name))
    except ValueError:
        return x509.DNSName(name)


def new_authority(common_name: str = "tinker-atropos CA", days: int = 3650) -> Authority:
    """A self-signed CA (P-256) that may sign service certificates only."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(key, hashes.SHA256())
    )
    return Authority(certificate, key)


def issue_certificate(
    authority: Authority, names: tuple[str, ...] = DEFAULT_NAMES, days: int = 365
) -> tuple[bytes, bytes]:
    """A certificate for ``names`` signed by ``authority``, for TLS servers and clients alike: (PEM
    certificate, PEM key)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(_name(names[0] if names else SERVICE_NAME))
        .issuer_name(authority.certificate.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.SubjectAlternativeName([_alternative_name(n) for n in names]), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .sign(authority.key, hashes.SHA256())
    )
    return certificate.public_bytes(serialization.Encoding.PEM), _pem(key)


def write_secrets(
    folder: Path, names: tuple[str, ...] = (), days: int = 365, secret_mode: int = 0o600, force: bool = False
) -> list[Path]:
    """Write every file of ``FILES`` into ``folder`` (made 0700); FileExistsError for one already there
    unless ``force``. ``secret_mode`` is the mode of keys, token and password (0644 where a container runs as
    another user than the one who made them, in a folder only that user can enter)."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not force:
        for name in FILES:
            if (folder / name).exists():
                raise FileExistsError(f"{folder / name} exists (--force replaces every file)")
    authority = new_authority(days=max(days, 3650))
    certificate, key = issue_certificate(authority, (*DEFAULT_NAMES, *names), days)
    contents = {
        "token": secrets.token_urlsafe(32).encode() + b"\n",
        "redis-password": secrets.token_urlsafe(32).encode() + b"\n",
        "ca.crt": authority.certificate.public_bytes(serialization.Encoding.PEM),
        "ca.key": _pem(authority.key),
        "tls.crt": certificate,
        "tls.key": key,
    }
    paths = []
    for name, data in contents.items():
        mode = 0o600 if name == "ca.key" else secret_mode if name in SECRET_FILES else 0o644
        write_secret(folder / name, data, mode=mode, replace=force)
        paths.append(folder / name)
    return paths
