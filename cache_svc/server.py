"""`hybridserve cache`: serves the BlockCache service over a Redis it owns."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass

import grpc

from cache_svc.service import BlockCacheServicer, add_to_server
from cache_svc.store import CheckpointStore, StoreConfig, StoreUnavailable
from hybridserve import grpc_server
from hybridserve.service_telemetry import METRICS_PORT_HELP, start_service_telemetry
from hybridserve.settings import Flag, add_settings_arguments, settings_from_args

log = logging.getLogger("hybridserve.cache")


@dataclass(frozen=True, slots=True)
class CacheServerSettings:
    """Where `hybridserve cache` listens; with StoreConfig, its flags (or HYBRIDSERVE_CACHE_* variables)."""

    host: str = "127.0.0.1"  # bind address
    port: int = 50053  # 0 picks a free port
    metrics_port: int = -1  # Prometheus /metrics: -1 = off, 0 = a free port


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
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, StoreConfig, "CACHE", flags=FLAGS, exclude=["socket_timeout_s"])
    add_settings_arguments(parser, CacheServerSettings, "CACHE", flags=FLAGS)


def create_server(
    config: StoreConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[grpc.Server, int, grpc_server.Health, CheckpointStore]:
    store = CheckpointStore(config)
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
    server, port, health_servicer, store = create_server(config, settings.host, settings.port)
    server.start()
    grpc_server.announce(settings.host, port)

    def stop() -> None:
        store.close()
        stop_telemetry()

    grpc_server.serve_until_signal(server, health_servicer, on_stop=stop)
    return 0
