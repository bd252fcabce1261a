"""`hybridserve cache`: serves the BlockCache service over a Redis it owns.

Every call needs the cluster token (HYBRIDSERVE_CLUSTER_TOKEN, comma separated to accept several
while rotating, or --cluster-token-file); without one the service refuses to start unless
--allow-anonymous says so. The Redis password comes from HYBRIDSERVE_CACHE_REDIS_PASSWORD or
--redis-password-file, never argv."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

from cache_svc.service import BlockCacheServicer, add_to_server
from cache_svc.store import CheckpointStore, StoreConfig, StoreCredentialsError, StoreUnavailable
from hybridserve import grpc_server
from hybridserve.auth import load_keys, load_secret
from hybridserve.errors import InvalidArgumentError
from hybridserve.service_telemetry import METRICS_PORT_HELP, start_service_telemetry
from hybridserve.settings import (
    CLUSTER_TOKEN_ENV,
    REDIS_PASSWORD_ENV,
    Flag,
    add_settings_arguments,
    secret_from_env,
    settings_from_args,
)
from hybridserve.tls import TlsSettings, add_tls_arguments

log = logging.getLogger("hybridserve.cache")


@dataclass(frozen=True, slots=True)
class CacheServerSettings:
    """Where `hybridserve cache` listens; with StoreConfig, its flags (or HYBRIDSERVE_CACHE_* variables)."""

    host: str = "127.0.0.1"  # bind address
    port: int = 50053  # 0 picks a free port
    metrics_port: int = -1  # Prometheus /metrics: -1 = off, 0 = a free port
    drain_timeout_s: float = 30.0  # on SIGTERM: seconds calls in flight may take to finish
    cluster_token_file: Path | None = None  # accepted cluster tokens, one per line (or CLUSTER_TOKEN_ENV)
    allow_anonymous: bool = False  # serve without a cluster token (anyone who reaches the port may publish)
    max_publish_bytes: int = 64 << 20  # one Publish's checkpoint, bytes at most
    redis_password_file: Path | None = None  # the Redis AUTH password's file (or REDIS_PASSWORD_ENV)

    def __post_init__(self) -> None:
        if not self.drain_timeout_s >= 0:
            raise InvalidArgumentError(f"--drain-timeout-s must be a number >= 0, got {self.drain_timeout_s}")


FLAGS = {
    "redis_url": Flag("Redis URL", name="--redis"),
    "redis_password_file": Flag(f"file holding the Redis password (or {REDIS_PASSWORD_ENV})", metavar="FILE"),
    "redis_tls_ca": Flag("rediss://: trust this CA for Redis's certificate", metavar="FILE"),
    "redis_tls_cert": Flag("rediss://: client certificate for Redis (tls-auth-clients)", metavar="FILE"),
    "redis_tls_key": Flag("rediss://: private key of --redis-tls-cert", metavar="FILE"),
    "cluster_token_file": Flag(f"accepted cluster tokens, one per line (or {CLUSTER_TOKEN_ENV})", metavar="FILE"),
    "allow_anonymous": Flag("serve without a cluster token: anyone who reaches the port may publish", switch=True),
    "max_publish_bytes": Flag("largest checkpoint one Publish may carry, MiB", name="--max-publish-mb", scale=1 << 20),
    "max_model_bytes": Flag(
        "checkpoint bytes kept per model fingerprint, MiB (0 = no bound)", name="--max-model-mb", scale=1 << 20
    ),
    "key_prefix": Flag("prefix of every Redis key"),
    "max_memory_bytes": Flag(
        "Redis maxmemory in MiB (LRU eviction beyond it); 0 = leave Redis's setting",
        name="--max-memory-mb",
        scale=1 << 20,
    ),  # fmt: skip
    "ttl_s": Flag("seconds a block stays after its last publish"),
    "worker_user": Flag("Redis ACL user for the workers' direct data path (block keys, data commands); '' = none"),
    "host": Flag("bind address"),
    "port": Flag("0 picks a free port"),
    "metrics_port": Flag(METRICS_PORT_HELP),
    "drain_timeout_s": Flag(grpc_server.DRAIN_HELP),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, StoreConfig, "CACHE", flags=FLAGS, exclude=["socket_timeout_s", "redis_password"])
    add_settings_arguments(parser, CacheServerSettings, "CACHE", flags=FLAGS)
    add_tls_arguments(parser, "CACHE")
    parser.add_argument("--redis-password", action=RefuseSecretFlag, help=argparse.SUPPRESS)


class RefuseSecretFlag(argparse.Action):
    """A password on the command line shows in `ps` to every user: refused, saying what to use."""

    def __call__(self, parser: argparse.ArgumentParser, *_args: object, **_kwargs: object) -> None:
        parser.error(f"--redis-password is refused (argv shows in ps): use {REDIS_PASSWORD_ENV} or a password file")


def cluster_tokens(settings: CacheServerSettings) -> frozenset[str]:
    """The accepted cluster tokens; SystemExit when there are none and anonymous use was not asked."""
    try:
        tokens = load_keys(settings.cluster_token_file, secret_from_env(CLUSTER_TOKEN_ENV))
    except OSError as exc:
        raise SystemExit(f"--cluster-token-file: {exc}") from None
    if not tokens and not settings.allow_anonymous:
        raise SystemExit(
            f"no cluster token: set {CLUSTER_TOKEN_ENV} (or --cluster-token-file) here and on the workers, "
            "or pass --allow-anonymous to let anyone who reaches this port read and write the cache"
        )
    if not tokens:
        log.warning("serving without a cluster token (--allow-anonymous): anyone who reaches the port may publish")
    return tokens


def redis_password(settings: CacheServerSettings) -> str | None:
    try:
        return load_secret(settings.redis_password_file, secret_from_env(REDIS_PASSWORD_ENV))
    except OSError as exc:
        raise SystemExit(f"--redis-password-file: {exc}") from None


def create_server(
    config: StoreConfig,
    host: str = "127.0.0.1",
    port: int = 0,
    tokens: frozenset[str] = frozenset(),
    tls: TlsSettings | None = None,
    max_publish_bytes: int = 64 << 20,
) -> tuple[grpc.Server, int, grpc_server.Health, CheckpointStore]:
    """The BlockCache server over a store of `config`, bound, not started; with `tokens`, every call
    but health needs one of them."""
    store = CheckpointStore(config)
    store.check_credentials()  # StoreCredentialsError: wrong credentials are not worth serving with
    try:
        store.configure_memory()
    except StoreUnavailable as exc:  # serve anyway: callers see misses until Redis answers
        log.warning("could not configure Redis now (%s); will serve misses until it answers", exc)
    server, bound, health_servicer = grpc_server.create_server(
        [add_to_server(BlockCacheServicer(store, max_publish_bytes))], host=host, port=port,
        tls=tls, keys=tokens, keys_name="cluster token",
    )  # fmt: skip
    return server, bound, health_servicer, store


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(CacheServerSettings, args)
    config = settings_from_args(StoreConfig, args, redis_password=redis_password(settings))
    tokens = cluster_tokens(settings)
    tls = settings_from_args(TlsSettings, args)
    stop_telemetry = start_service_telemetry("hybridserve-cache", settings.metrics_port, settings.host)
    try:
        server, port, health_servicer, store = create_server(
            config, settings.host, settings.port, tokens, tls, settings.max_publish_bytes
        )
    except StoreCredentialsError as exc:
        stop_telemetry()
        raise SystemExit(
            f"cache: {exc}. Set the password in {REDIS_PASSWORD_ENV} or --redis-password-file (or"
            " user:password in the --redis URL) to Redis's requirepass / ACL user"
        ) from None
    stop_watching = grpc_server.watch_health(health_servicer, is_alive=lambda: True, is_ready=store.ping)
    server.start()
    stop_requested = grpc_server.stop_on_signal()
    grpc_server.announce(settings.host, port)

    def stop() -> None:
        stop_watching.set()
        store.close()
        stop_telemetry()

    grpc_server.serve_until_signal(
        server, health_servicer, grace_s=settings.drain_timeout_s, on_stop=stop, stop=stop_requested
    )
    return 0
