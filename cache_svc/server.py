"""`hybridserve cache`: serves the BlockCache service over a Redis it owns."""

from __future__ import annotations

import argparse
import logging

import grpc
from grpc_health.v1 import health

from cache_svc.service import BlockCacheServicer, add_to_server
from cache_svc.store import CheckpointStore, StoreConfig, StoreUnavailable
from hybridserve import grpc_server
from hybridserve.cliutil import env_default
from hybridserve.service_telemetry import add_metrics_arguments, start_service_telemetry

log = logging.getLogger("hybridserve.cache")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--redis", default=env_default("REDIS_URL", "redis://127.0.0.1:6379/0"), help="Redis URL")
    parser.add_argument("--redis-password", default=env_default("REDIS_PASSWORD", None))
    parser.add_argument("--key-prefix", default=env_default("CACHE_KEY_PREFIX", "hybridserve"))
    parser.add_argument(
        "--max-memory-mb",
        type=int,
        default=env_default("CACHE_MAX_MEMORY_MB", 1024, int),
        help="Redis maxmemory (LRU eviction beyond it); 0 = leave Redis's setting",
    )
    parser.add_argument(
        "--ttl-s",
        type=int,
        default=env_default("CACHE_TTL_S", 86400, int),
        help="seconds a block stays after its last publish",
    )
    parser.add_argument("--host", default=env_default("CACHE_HOST", "127.0.0.1"))
    parser.add_argument("--port", type=int, default=env_default("CACHE_PORT", 50053, int), help="0 = free port")
    add_metrics_arguments(parser, "CACHE")


def create_server(
    config: StoreConfig, host: str = "127.0.0.1", port: int = 0
) -> tuple[grpc.Server, int, health.HealthServicer, CheckpointStore]:
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
    config = StoreConfig(
        url=args.redis, password=args.redis_password, key_prefix=args.key_prefix,
        max_memory_bytes=args.max_memory_mb << 20, ttl_s=args.ttl_s,
    )  # fmt: skip
    stop_telemetry = start_service_telemetry("hybridserve-cache", args.metrics_port, args.host)
    server, port, health_servicer, store = create_server(config, args.host, args.port)
    server.start()
    grpc_server.announce(args.host, port)
    grpc_server.serve_until_signal(server, health_servicer, on_stop=lambda: (store.close(), stop_telemetry()))
    return 0
