"""`hybridserve scheduler`: serves the stateless Scheduler service.

With a cluster token (HYBRIDSERVE_CLUSTER_TOKEN, comma separated to accept several while rotating, or
--cluster-token-file) every call but health and reflection needs `authorization: Bearer TOKEN`, as on
the cache service; `hybridserve up` passes its stack's token, and workers send theirs. Without one the
scheduler serves anyone who reaches its port (it holds no data: a caller can only ask for plans)."""

from __future__ import annotations

import argparse
import logging
from dataclasses import dataclass
from pathlib import Path

import grpc

from hybridserve import grpc_server
from hybridserve.auth import load_keys
from hybridserve.errors import InvalidArgumentError
from hybridserve.grpc_server import DRAIN_HELP
from hybridserve.service_telemetry import METRICS_PORT_HELP, start_service_telemetry
from hybridserve.settings import CLUSTER_TOKEN_ENV, Flag, add_settings_arguments, secret_from_env, settings_from_args
from hybridserve.tls import TlsSettings, add_tls_arguments
from scheduler_svc import service

log = logging.getLogger("hybridserve.scheduler")


def create_server(
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 32,
    max_message_bytes: int = grpc_server.DEFAULT_MAX_MESSAGE_BYTES,
    bench_service: bool = False,
    tls: TlsSettings | None = None,
    tokens: frozenset[str] = frozenset(),
) -> tuple[grpc.Server, int, grpc_server.Health]:
    """The Scheduler service with health and reflection (and SchedulerBench when asked), bound but
    not started; with `tokens`, every other call needs one of them."""
    adders = [service.add_to_server] + ([service.add_bench_to_server] if bench_service else [])
    return grpc_server.create_server(
        adders,
        host=host,
        port=port,
        max_workers=max_workers,
        max_message_bytes=max_message_bytes,
        tls=tls,
        keys=tokens,
        keys_name="cluster token",
    )


@dataclass(frozen=True, slots=True)
class SchedulerServerSettings:
    """`hybridserve scheduler`'s settings: flags --host, --port, ... or HYBRIDSERVE_SCHEDULER_* variables."""

    host: str = "127.0.0.1"  # bind address
    port: int = 50051  # 0 picks a free port
    max_workers: int = 32  # threads serving calls
    max_message_bytes: int = grpc_server.DEFAULT_MAX_MESSAGE_BYTES  # largest request accepted, bytes
    bench_service: bool = False  # also serve the benchmark-only SchedulerBench service
    metrics_port: int = -1  # Prometheus /metrics: -1 = off, 0 = a free port
    drain_timeout_s: float = 30.0  # on SIGTERM: seconds calls in flight may take to finish
    cluster_token_file: Path | None = None  # accepted cluster tokens, one per line (or CLUSTER_TOKEN_ENV)

    def __post_init__(self) -> None:
        if not self.drain_timeout_s >= 0:
            raise InvalidArgumentError(f"--drain-timeout-s must be a number >= 0, got {self.drain_timeout_s}")


FLAGS = {
    "host": Flag("bind address"),
    "port": Flag("0 picks a free port"),
    "max_workers": Flag("threads serving calls"),
    "max_message_bytes": Flag("largest request accepted (bigger ones get RESOURCE_EXHAUSTED)"),
    "bench_service": Flag("also serve the benchmark-only SchedulerBench service (Echo)"),
    "metrics_port": Flag(METRICS_PORT_HELP),
    "drain_timeout_s": Flag(DRAIN_HELP),
    "cluster_token_file": Flag(
        f"accepted cluster tokens, one per line (or {CLUSTER_TOKEN_ENV}); none: anyone who reaches the port may plan",
        metavar="FILE",
    ),
}


def cluster_tokens(settings: SchedulerServerSettings) -> frozenset[str]:
    """The accepted cluster tokens; empty (the scheduler is open) when none is configured."""
    try:
        tokens = load_keys(settings.cluster_token_file, secret_from_env(CLUSTER_TOKEN_ENV))
    except OSError as exc:
        raise SystemExit(f"--cluster-token-file: {exc}") from None
    if not tokens:
        log.info("no cluster token: anyone who reaches the port may ask for plans")
    return tokens


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_settings_arguments(parser, SchedulerServerSettings, "SCHEDULER", flags=FLAGS)
    add_tls_arguments(parser, "SCHEDULER")


def run(args: argparse.Namespace) -> int:
    settings = settings_from_args(SchedulerServerSettings, args)
    stop_telemetry = start_service_telemetry("hybridserve-scheduler", settings.metrics_port, settings.host)
    server, port, health_servicer = create_server(
        settings.host,
        settings.port,
        settings.max_workers,
        settings.max_message_bytes,
        settings.bench_service,
        settings_from_args(TlsSettings, args),
        cluster_tokens(settings),
    )
    server.start()
    stop_requested = grpc_server.stop_on_signal()
    grpc_server.announce(settings.host, port)
    grpc_server.serve_until_signal(
        server, health_servicer, grace_s=settings.drain_timeout_s, on_stop=stop_telemetry, stop=stop_requested
    )
    return 0
