"""Optional TLS and mutual TLS for every gRPC server and client of pdserve (and the HTTP API, which serves
the same certificate): the flags (certificate, key, CA, the name servers' certificates carry) and the
credentials and channels built from them. Off (plain text) unless a certificate or a CA is given."""
from __future__ import annotations

import functools
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

import grpc

from shared.serving.server.settings import setting


def _read(path: str, flag: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ValueError(f"cannot read {flag} {path}: {exc}") from None


class _EncryptedKey(Exception):
    """Raised by the password callback: the key needs a passphrase, which neither gRPC nor pdserve takes."""


def _no_passphrase() -> bytes:
    raise _EncryptedKey()


def _check_certificates(flag: str, path: str) -> None:
    """ValueError unless path holds at least one PEM certificate."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=path)
    except OSError as exc:  # ssl.SSLError included
        raise ValueError(f"{flag} {path} holds no readable PEM certificate ({exc})") from None


def _check_key_pair(cert: str, key: str) -> None:
    """ValueError unless key is the unencrypted PEM private key of cert's (first) certificate. gRPC
    would only find out when its server fails to start, and then reports it as a failure to bind."""
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=_no_passphrase)
    except _EncryptedKey:
        raise ValueError(f"--tls-key {key} is encrypted: give it unencrypted (gRPC takes no passphrase)") from None
    except ssl.SSLError as exc:
        if exc.reason == "KEY_VALUES_MISMATCH":
            raise ValueError(f"--tls-key {key} is not the private key of --tls-cert {cert}") from None
        raise ValueError(f"--tls-key {key} holds no PEM private key usable with --tls-cert {cert} ({exc})") from None
    except OSError as exc:
        raise ValueError(f"cannot read --tls-cert {cert} or --tls-key {key}: {exc}") from None


@dataclass(frozen=True)
class TlsConfig:
    """A service's TLS files. cert + key: its servers speak TLS, and its client channels present the
    certificate (to peers requiring mTLS). ca: its servers require client certificates signed by it
    (mTLS), and its clients verify servers with it. A certificate used both ways needs the serverAuth
    and clientAuth key usages (or none)."""

    tls_cert: str = field(default="", metadata=setting(
        "PEM certificate chain this service presents, as a server and as a client (TLS on with --tls-key)"
    ))
    tls_key: str = field(default="", metadata=setting("PEM private key of --tls-cert"))
    tls_ca: str = field(default="", metadata=setting(
        "PEM CA bundle: servers require client certificates it signed (mTLS) and clients verify servers "
        "with it (default for clients: the system roots)"
    ))
    tls_server_name: str = field(default="", metadata=setting(
        "the name peers' server certificates carry, checked instead of the dialled host (pods dialled "
        "by IP in Kubernetes)"
    ))

    def __post_init__(self) -> None:
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("--tls-cert and --tls-key go together")
        for flag, path in (("--tls-cert", self.tls_cert), ("--tls-key", self.tls_key), ("--tls-ca", self.tls_ca)):
            if path and not Path(path).is_file():
                raise ValueError(f"{flag} {path}: no such file")
        # The files' contents are checked here, at start-up, so a bad one is named by its flag.
        if self.tls_cert:
            _check_certificates("--tls-cert", self.tls_cert)
            _check_key_pair(self.tls_cert, self.tls_key)
        if self.tls_ca:
            _check_certificates("--tls-ca", self.tls_ca)

    @property
    def is_enabled(self) -> bool:
        return bool(self.tls_cert or self.tls_ca)

    def require_server_certificate(self) -> None:
        """ValueError when TLS is on without a certificate to serve (for services: their servers need one)."""
        if self.is_enabled and not self.tls_cert:
            raise ValueError("a TLS server needs --tls-cert and --tls-key (--tls-ca alone only configures clients)")

    @functools.cached_property
    def _files(self) -> tuple[bytes | None, bytes | None, bytes | None]:
        cert = _read(self.tls_cert, "--tls-cert") if self.tls_cert else None
        key = _read(self.tls_key, "--tls-key") if self.tls_key else None
        ca = _read(self.tls_ca, "--tls-ca") if self.tls_ca else None
        return cert, key, ca

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """None: plain text. ValueError when TLS is asked for without a certificate to serve."""
        if not self.is_enabled:
            return None
        self.require_server_certificate()
        cert, key, ca = self._files
        return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """None: plain text."""
        if not self.is_enabled:
            return None
        cert, key, ca = self._files
        return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)

    def _options(self, options: Sequence[tuple[str, Any]]) -> list[tuple[str, Any]]:
        if self.is_enabled and self.tls_server_name:
            return [*options, ("grpc.ssl_target_name_override", self.tls_server_name)]
        return list(options)

    def aio_channel(self, address: str, *, options: Sequence[tuple[str, Any]] = (), interceptors=None):
        """An asyncio channel to address, with TLS when this config has it."""
        credentials = self.channel_credentials()
        if credentials is None:
            return grpc.aio.insecure_channel(address, options=self._options(options), interceptors=interceptors)
        return grpc.aio.secure_channel(address, credentials, options=self._options(options), interceptors=interceptors)

    def channel(self, address: str, *, options: Sequence[tuple[str, Any]] = ()) -> grpc.Channel:
        """A blocking channel to address, with TLS when this config has it."""
        credentials = self.channel_credentials()
        if credentials is None:
            return grpc.insecure_channel(address, options=self._options(options))
        return grpc.secure_channel(address, credentials, options=self._options(options))
