"""`hybridserve scheduler`: serves the stateless Scheduler service."""

from __future__ import annotations

import argparse
import logging

import grpc
from grpc_health.v1 import health

from hybridserve import grpc_server
from hybridserve.cliutil import env_default
from hybridserve.service_telemetry import add_metrics_arguments, start_service_telemetry
from scheduler_svc import service

log = logging.getLogger("hybridserve.scheduler")


def create_server(
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 32,
    max_message_bytes: int = grpc_server.DEFAULT_MAX_MESSAGE_BYTES,
    bench_service: bool = False,
) -> tuple[grpc.Server, int, health.HealthServicer]:
    """The Scheduler service with health and reflection (and SchedulerBench when asked), bound but
    not started."""
    adders = [service.add_to_server] + ([service.add_bench_to_server] if bench_service else [])
    return grpc_server.create_server(
        adders,
        host=host,
        port=port,
        max_workers=max_workers,
        max_message_bytes=max_message_bytes,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=env_default("SCHEDULER_HOST", "127.0.0.1"), help="bind address")
    parser.add_argument(
        "--port", type=int, default=env_default("SCHEDULER_PORT", 50051, int), help="0 picks a free port"
    )
    parser.add_argument(
        "--max-workers",
        type=int,
        default=env_default("SCHEDULER_MAX_WORKERS", 32, int),
        help="threads serving calls",
    )
    parser.add_argument(
        "--max-message-bytes",
        type=int,
        default=env_default("SCHEDULER_MAX_MESSAGE_BYTES", grpc_server.DEFAULT_MAX_MESSAGE_BYTES, int),
        help="largest request accepted (bigger ones get RESOURCE_EXHAUSTED)",
    )
    parser.add_argument(
        "--bench-service",
        action="store_true",
        help="also serve the benchmark-only SchedulerBench service (Echo)",
    )
    add_metrics_arguments(parser, "SCHEDULER")


def run(args: argparse.Namespace) -> int:
    stop_telemetry = start_service_telemetry("hybridserve-scheduler", args.metrics_port, args.host)
    server, port, health_servicer = create_server(
        args.host, args.port, args.max_workers, args.max_message_bytes, args.bench_service
    )
    server.start()
    grpc_server.announce(args.host, port)
    grpc_server.serve_until_signal(server, health_servicer, on_stop=stop_telemetry)
    return 0
