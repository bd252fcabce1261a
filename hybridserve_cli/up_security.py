"""The secrets of one `hybridserve up` stack, made fresh at every start and handed to each child
through its environment or files of mode 0600 in a private directory (mode 0700), never argv:

- the cluster token (scheduler and cache service; the worker sends it),
- the workers' checkpoint MAC key (worker),
- the Redis password (embedded Redis's config file; the cache service),
- with `--tls`, a throwaway CA and one certificate per service (server and client at once), and a
  client certificate for `hybridserve generate`; every gRPC hop is mTLS,
- API keys on the Generation API (worker and gateway): the keys of `--api-key-file` when given; on a
  host other than loopback without that file, one random key written to API_KEY_FILE; none on loopback.
  The gateway reaches the worker with an internal key of its own.

The private directory is removed when the stack stops."""

from __future__ import annotations

import ipaddress
import secrets
import shutil
import socket
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from hybridserve.auth import load_keys, write_private
from hybridserve.settings import (
    API_KEYS_ENV,
    CHECKPOINT_KEY_ENV,
    CLUSTER_TOKEN_ENV,
    REDIS_PASSWORD_ENV,
)

TLS_IDENTITIES = ("scheduler", "cache", "worker", "gateway", "client")
GATEWAY_WORKER_KEY_ENV = "HYBRIDSERVE_GATEWAY_WORKER_API_KEY"  # gateway/server.py reads it
API_KEY_FILE = "api-key"


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


@dataclass
class StackSecrets:
    """One stack's secrets and TLS files; `env_for` and `tls_flags` say what each child gets."""

    directory: Path  # private (0700), removed by `close`
    cluster_token: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    checkpoint_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    redis_password: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    gateway_worker_key: str = field(default_factory=lambda: secrets.token_urlsafe(32))
    api_keys: frozenset[str] = frozenset()  # accepted on the Generation API; empty = open
    api_key_file: Path | None = None  # where a generated key was written (non-loopback host)
    ca: Path | None = None  # with --tls
    certs: dict[str, tuple[Path, Path]] = field(default_factory=dict)  # identity -> (cert, key)

    @classmethod
    def create(cls, host: str, tls: bool, api_key_file: Path | None) -> StackSecrets:
        directory = Path(tempfile.mkdtemp(prefix="hybridserve-up-"))
        directory.chmod(0o700)
        made = cls(directory)
        if api_key_file is not None:
            made.api_keys = load_keys(api_key_file, None)
            if not made.api_keys:
                raise OSError(f"--api-key-file {api_key_file} holds no key")
        elif not is_loopback(host):
            key = secrets.token_urlsafe(32)
            made.api_key_file = write_private(directory / API_KEY_FILE, (key + "\n").encode())
            made.api_keys = frozenset({key})
        if tls:
            from hybridserve.certs import write_stack_certs  # cryptography loads only for --tls

            names = ("localhost", "127.0.0.1", "::1", *([host] if host not in ("0.0.0.0", "::", "") else []),
                     socket.gethostname())  # fmt: skip
            made.ca, issued = write_stack_certs(directory / "tls", TLS_IDENTITIES, tuple(dict.fromkeys(names)))
            made.certs = {name: (files.cert, files.key) for name, files in issued.items()}
        return made

    @property
    def redis_dir(self) -> Path:
        path = self.directory / "redis"
        path.mkdir(mode=0o700, exist_ok=True)
        return path

    def env_for(self, service: str) -> dict[str, str]:
        """The secrets one child reads from its environment (and only those it needs)."""
        if service == "cache":
            return {CLUSTER_TOKEN_ENV: self.cluster_token, REDIS_PASSWORD_ENV: self.redis_password}
        if service == "scheduler":
            return {CLUSTER_TOKEN_ENV: self.cluster_token}
        if service == "worker":
            env = {CLUSTER_TOKEN_ENV: self.cluster_token, CHECKPOINT_KEY_ENV: self.checkpoint_key}
            if self.api_keys:
                env[API_KEYS_ENV] = ",".join(sorted(self.api_keys | {self.gateway_worker_key}))
            return env
        if service == "gateway":
            env = {API_KEYS_ENV: ",".join(sorted(self.api_keys))} if self.api_keys else {}
            return env | ({GATEWAY_WORKER_KEY_ENV: self.gateway_worker_key} if self.api_keys else {})
        return {}

    def tls_flags(self, service: str) -> list[str]:
        """mTLS for a server that is also a client: its certificate, the stack's CA on both sides."""
        if self.ca is None:
            return []
        cert, key = self.certs[service]
        ca = str(self.ca)
        return ["--tls-cert", str(cert), "--tls-key", str(key), "--tls-client-ca", ca, "--tls-ca", ca]

    def client_env(self) -> str:
        """What goes before `hybridserve generate` (the API key's variable), or ""."""
        if self.api_key_file is not None:
            return f"HYBRIDSERVE_API_KEY=$(cat {self.api_key_file}) "
        return "HYBRIDSERVE_API_KEY=<a key of --api-key-file> " if self.api_keys else ""

    def client_flags(self) -> str:
        """What goes after it (the TLS files), or ""."""
        if self.ca is None:
            return ""
        cert, key = self.certs["client"]
        return f" --tls-ca {self.ca} --tls-cert {cert} --tls-key {key}"

    def close(self) -> None:
        shutil.rmtree(self.directory, ignore_errors=True)
