"""A throwaway certificate authority and the certificates it signs (the `cryptography` package), for
`hybridserve up --tls` and the tests: one CA per stack, one certificate per process usable both as a
server certificate and as a client certificate (a worker is both), names for loopback and the host.

Keys are ECDSA P-256; files are PEM, keys written with mode 0600 in a directory of mode 0700."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from hybridserve.auth import write_private

DEFAULT_NAMES = ("localhost", "127.0.0.1", "::1")
VALID_DAYS = 30


@dataclass(frozen=True, slots=True)
class CertFiles:
    cert: Path  # PEM certificate
    key: Path  # PEM private key (mode 0600)


@dataclass(frozen=True, slots=True)
class Authority:
    """A CA's certificate and key, able to issue more certificates."""

    cert: x509.Certificate
    key: ec.EllipticCurvePrivateKey

    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _san(names: tuple[str, ...]) -> x509.SubjectAlternativeName:
    entries: list[x509.GeneralName] = []
    for name in names:
        try:
            entries.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            entries.append(x509.DNSName(name))
    return x509.SubjectAlternativeName(entries)


def _validity() -> tuple[datetime.datetime, datetime.datetime]:
    now = datetime.datetime.now(datetime.UTC)
    return now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=VALID_DAYS)


def make_authority(common_name: str = "hybridserve throwaway CA") -> Authority:
    key = ec.generate_private_key(ec.SECP256R1())
    not_before, not_after = _validity()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(_name(common_name))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )  # fmt: skip
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Authority(cert, key)


def issue(authority: Authority, common_name: str, names: tuple[str, ...] = DEFAULT_NAMES) -> tuple[bytes, bytes]:
    """(certificate PEM, key PEM) for common_name, valid for `names` (DNS names or IPs), usable as a
    TLS server and a TLS client certificate."""
    key = ec.generate_private_key(ec.SECP256R1())
    not_before, not_after = _validity()
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common_name))
        .issuer_name(authority.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_san(names), critical=False)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False
        )
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(authority.key.public_key()), critical=False)
        .sign(authority.key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return cert.public_bytes(serialization.Encoding.PEM), key_pem


def write_stack_certs(
    directory: Path, identities: tuple[str, ...], names: tuple[str, ...] = DEFAULT_NAMES
) -> tuple[Path, dict[str, CertFiles]]:
    """A fresh CA in directory/ca.pem and one certificate per identity (identity.pem, identity.key);
    returns the CA file and the files by identity. The CA's key is never written."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    directory.chmod(0o700)
    authority = make_authority()
    ca_file = directory / "ca.pem"
    ca_file.write_bytes(authority.pem())
    files: dict[str, CertFiles] = {}
    for identity in identities:
        cert_pem, key_pem = issue(authority, f"hybridserve {identity}", names)
        cert_file = directory / f"{identity}.pem"
        cert_file.write_bytes(cert_pem)
        files[identity] = CertFiles(cert_file, write_private(directory / f"{identity}.key", key_pem))
    return ca_file, files
