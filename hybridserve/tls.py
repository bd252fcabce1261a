"""TLS for every gRPC hop, the same flags on every server and client (docs/design.md, The public contract):

    --tls-cert FILE --tls-key FILE   this process's certificate chain and key (PEM): served by its
                                     server, and presented as a client certificate when it dials
                                     another service that asks for one (mTLS)
    --tls-client-ca FILE             server side: require client certificates signed by this CA (mTLS)
    --tls-ca FILE                    client side: trust servers signed by this CA (the system roots
                                     when only --tls-cert is given); with it, channels use TLS
    --reflection / --no-reflection   serve gRPC reflection (on by default)

Every flag has its HYBRIDSERVE_<SERVICE>_<FIELD> variable. Without any of them everything stays
plaintext, as before. Certificates are files, not secrets in argv: the key file should be mode 0600.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from hybridserve.auth import AUTHORIZATION
from hybridserve.settings import Flag, Parser, add_settings_arguments


@dataclass(frozen=True, slots=True)
class TlsSettings:
    """A process's TLS files and reflection switch (flags, or HYBRIDSERVE_<SERVICE>_TLS_* variables)."""

    tls_cert: Path | None = None  # PEM certificate chain: served, and presented as a client certificate
    tls_key: Path | None = None  # PEM private key of tls_cert
    tls_client_ca: Path | None = None  # server: require client certificates signed by this CA (mTLS)
    tls_ca: Path | None = None  # client: trust servers signed by this CA; set = dial with TLS
    tls_server_name: str = ""  # client: the name to check in servers' certificates ("" = the host dialled)
    reflection: bool = True  # serve gRPC reflection

    def __post_init__(self) -> None:
        if (self.tls_cert is None) != (self.tls_key is None):
            raise SystemExit("--tls-cert and --tls-key go together")
        if self.tls_client_ca is not None and self.tls_cert is None:
            raise SystemExit("--tls-client-ca (mTLS) needs --tls-cert and --tls-key for the server")

    @property
    def serves_tls(self) -> bool:
        return self.tls_cert is not None

    @property
    def dials_tls(self) -> bool:
        return self.tls_ca is not None

    def server_credentials(self) -> grpc.ServerCredentials | None:
        """TLS (mTLS with tls_client_ca) server credentials; None = plaintext."""
        if self.tls_cert is None or self.tls_key is None:
            return None
        pair = (_read(self.tls_key), _read(self.tls_cert))
        client_ca = _read(self.tls_client_ca) if self.tls_client_ca is not None else None
        return grpc.ssl_server_credentials(
            [pair], root_certificates=client_ca, require_client_auth=client_ca is not None
        )

    def channel_credentials(self) -> grpc.ChannelCredentials | None:
        """TLS channel credentials presenting this process's certificate; None = plaintext."""
        if self.tls_ca is None:
            return None
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.tls_ca),
            private_key=_read(self.tls_key) if self.tls_key is not None else None,
            certificate_chain=_read(self.tls_cert) if self.tls_cert is not None else None,
        )

    def channel_options(self) -> list[tuple[str, Any]]:
        return [("grpc.ssl_target_name_override", self.tls_server_name)] if self.tls_server_name else []


FLAGS = {
    "tls_cert": Flag("PEM certificate (chain) served, and presented to servers that ask (mTLS)", metavar="FILE"),
    "tls_key": Flag("PEM private key of --tls-cert", metavar="FILE"),
    "tls_client_ca": Flag("require client certificates signed by this CA (mTLS)", metavar="FILE"),
    "tls_ca": Flag("dial other services with TLS, trusting this CA", metavar="FILE"),
    "tls_server_name": Flag("the name to check in servers' certificates (default: the host dialled)"),
    "reflection": Flag("serve gRPC reflection (grpcurl)"),
}
CLIENT_FIELDS = ("tls_cert", "tls_key", "tls_ca", "tls_server_name")


def add_tls_arguments(parser: Parser, service: str, client_only: bool = False) -> None:
    """The TLS flags of a server (all of them) or a pure client (`client_only`)."""
    group = parser.add_argument_group("security (TLS)") if isinstance(parser, argparse.ArgumentParser) else parser
    only = CLIENT_FIELDS if client_only else None
    add_settings_arguments(group, TlsSettings, service, flags=FLAGS, only=only)


def _read(path: Path) -> bytes:
    try:
        return Path(path).expanduser().read_bytes()
    except OSError as exc:
        raise SystemExit(f"cannot read TLS file {path}: {exc.strerror}") from None


def open_channel(
    address: str,
    tls: TlsSettings | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.Channel:
    """A channel to address: TLS when tls says so (tls.tls_ca set), else plaintext."""
    credentials = tls.channel_credentials() if tls is not None else None
    if credentials is None:
        return grpc.insecure_channel(address, options=list(options))
    return grpc.secure_channel(address, credentials, options=[*options, *tls.channel_options()])  # type: ignore[union-attr]


def open_aio_channel(
    address: str,
    tls: TlsSettings | None = None,
    options: Sequence[tuple[str, Any]] = (),
) -> grpc.aio.Channel:
    """open_channel for grpc.aio."""
    credentials = tls.channel_credentials() if tls is not None else None
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=list(options))
    return grpc.aio.secure_channel(address, credentials, options=[*options, *tls.channel_options()])  # type: ignore[union-attr]


def bearer_metadata(token: str | None) -> tuple[tuple[str, str], ...]:
    """Call metadata carrying token (empty without one)."""
    return ((AUTHORIZATION, f"Bearer {token}"),) if token else ()
