"""`hybridserve cache`: serves the BlockCache service over a Redis it owns."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import grpc

from cache_svc.service import BlockCacheServicer, add_to_server
from cache_svc.store import CheckpointStore, StoreConfig, StoreCredentialsError, StoreUnavailable
from hybridserve import grpc_server
from hybridserve.errors import InvalidArgumentError
from hybridserve.service_telemetry import METRICS_PORT_HELP, start_service_telemetry
from hybridserve.settings import Flag, add_settings_arguments, settings_from_args

log = logging.getLogger("hybridserve.cache")


@dataclass(frozen=True, slots=True)
class CacheServerSettings:
    """Where `hybridserve cache` listens; with StoreConfig, its flags (or HYBRIDSERVE_CACHE_* variables)."""

    host: str = "127.0.0.1"  # bind address
    port: int = 50053  # 0 picks a free port
    metrics_port: int = -1  # Prometheus /metrics: -1 = off, 0 = a free port
    drain_timeout_s: float = 30.0  # on SIGTERM: seconds calls in flight may take to finish

    def __post_init__(self) -> None:
        if not self.drain_timeout_s >= 0:
            raise InvalidArgumentError(f"--drain-timeout-s must be a number >= 0, got {self.drain_timeout_s}")


FLAGS = {
    "redis_url": Flag("Redis URL", name="--redis"),
    "redis_password": Flag("Redis password (prefer the variable: argv is visible to every user)"),
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
    add_settings_arguments(parser, StoreConfig, "CACHE", flags=FLAGS, exclude=["socket_timeout_s"])
    add_settings_arguments(parser, CacheServerSettings, "CACHE", flags=FLAGS)


def create_server(
    config: StoreConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[grpc.Server, int, grpc_server.Health, CheckpointStore]:
    store = CheckpointStore(config)
    store.check_credentials()  # StoreCredentialsError: wrong credentials are not worth serving with
    try:
        store.configure_memory()
    except StoreUnavailable as exc:  # serve anyway: callers see misses until Redis answers
        log.warning("could not configure Redis now (%s); will serve misses until it answers", exc)
    server, bound, health_servicer = grpc_server.create_server(
        [add_to_server(BlockCacheServicer(store))], host=host, port=port
    )
    return server, bound, health_servicer, store


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(CacheServerSettings, args)
    config = settings_from_args(StoreConfig, args)
    stop_telemetry = start_service_telemetry("hybridserve-cache", settings.metrics_port, settings.host)
    try:
        server, port, health_servicer, store = create_server(config, settings.host, settings.port)
    except StoreCredentialsError as exc:
        stop_telemetry()
        raise SystemExit(
            f"cache: {exc}. Set the password in HYBRIDSERVE_CACHE_REDIS_PASSWORD (or user:password in the"
            " --redis URL) to Redis's requirepass / ACL user"
        ) from None
    stop_watching = grpc_server.watch_health(health_servicer, is_alive=lambda: True, is_ready=store.ping)
    server.start()
    grpc_server.announce(settings.host, port)

    def stop() -> None:
        stop_watching.set()
        store.close()
        stop_telemetry()

    grpc_server.serve_until_signal(server, health_servicer, grace_s=settings.drain_timeout_s, on_stop=stop)
    return 0
