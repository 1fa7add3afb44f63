"""Certificates made at test time (the `cryptography` package): a CA, certificates it signs for
127.0.0.1/localhost usable as server and client, and PEM files to point the services' flags at."""
from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertFiles:
    cert: Path
    key: Path


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_key(key: ec.EllipticCurvePrivateKey, path: Path) -> None:
    path.write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    ))


class CertificateAuthority:
    """A self-signed CA that issues leaf certificates into a directory."""

    def __init__(self, directory: Path, name: str = "pdserve-test-ca"):
        self.directory = directory
        self._key = ec.generate_private_key(ec.SECP256R1())
        self._name = _name(name)
        now = datetime.datetime.now(datetime.timezone.utc)
        self._cert = (
            x509.CertificateBuilder()
            .subject_name(self._name).issuer_name(self._name)
            .public_key(self._key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self._key, hashes.SHA256())
        )
        self.cert_path = directory / f"{name}.pem"
        self.cert_path.write_bytes(self._cert.public_bytes(serialization.Encoding.PEM))

    def issue(self, name: str, dns_names: tuple[str, ...] = ("localhost",),
              ip_addresses: tuple[str, ...] = ("127.0.0.1",)) -> CertFiles:
        """A leaf for both TLS roles (serverAuth and clientAuth), valid for the given names."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = datetime.datetime.now(datetime.timezone.utc)
        alt_names = [x509.DNSName(n) for n in dns_names]
        alt_names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
        cert = (
            x509.CertificateBuilder()
            .subject_name(_name(name)).issuer_name(self._name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(alt_names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                           critical=False)
            .sign(self._key, hashes.SHA256())
        )
        files = CertFiles(self.directory / f"{name}.pem", self.directory / f"{name}.key")
        files.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        _write_key(key, files.key)
        return files


def make_pki(directory: Path) -> dict:
    """A CA with a server and a client certificate, and a client certificate of another CA."""
    ca = CertificateAuthority(directory)
    rogue = CertificateAuthority(directory, name="rogue-ca")
    return dict(ca=ca, server=ca.issue("server"), client=ca.issue("client"), rogue_client=rogue.issue("rogue"))


def server_tls(pki: dict, *, mutual: bool):
    """The TlsConfig of a server with pki's server certificate (requiring client certificates when mutual)."""
    from shared.serving.server.tls import TlsConfig

    return TlsConfig(tls_cert=str(pki["server"].cert), tls_key=str(pki["server"].key),
                     tls_ca=str(pki["ca"].cert_path) if mutual else "")
