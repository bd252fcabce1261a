"""How a command-line client (`hybridserve generate`, `bench`, `health`) reaches a secured server:
TLS flags (hybridserve.tls; HYBRIDSERVE_CLIENT_TLS_* variables) and the API key it sends.

The key comes from HYBRIDSERVE_API_KEY (preferred: argv shows in `ps` to every user of the machine)
or `--api-key`, and travels as `authorization: Bearer KEY` on every call."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from hybridserve.grpc_auth import with_bearer
from hybridserve.settings import API_KEY_ENV, secret_from_env, settings_from_args
from hybridserve.tls import TlsSettings, add_tls_arguments, open_channel

SERVICE = "CLIENT"  # HYBRIDSERVE_CLIENT_TLS_CA, ...


@dataclass(frozen=True, slots=True)
class ClientSecurity:
    tls: TlsSettings = field(default_factory=TlsSettings)  # plaintext unless tls_ca is set
    api_key: str | None = None  # sent as authorization: Bearer KEY


def add_client_security_arguments(parser: argparse.ArgumentParser) -> None:
    add_tls_arguments(parser, SERVICE, client_only=True)
    parser.add_argument(
        "--api-key", default=None, metavar="KEY",
        help=f"API key sent as authorization: Bearer KEY (prefer {API_KEY_ENV}: argv shows in ps)",
    )  # fmt: skip


def client_security_from_args(args: argparse.Namespace) -> ClientSecurity:
    key = getattr(args, "api_key", None) or secret_from_env(API_KEY_ENV)
    return ClientSecurity(settings_from_args(TlsSettings, args), key)


def open_client_channel(
    address: str, security: ClientSecurity | None = None, options: Sequence[tuple[str, Any]] = ()
) -> grpc.Channel:
    """A channel to address with the client's TLS and API key (plaintext and keyless by default)."""
    security = security or ClientSecurity()
    return with_bearer(open_channel(address, security.tls, options), security.api_key)
