"""Observability wiring every server command shares: start-up of tracing
and the metrics endpoint, and the server interceptors.

Each server's settings dataclass has a `metrics_port` field (-1 = off, 0 = a free port, printed as
`metrics on HOST:PORT`). A server's `run()` calls, before it builds its gRPC server:

    stop_telemetry = start_service_telemetry("hybridserve-cache", args.metrics_port, args.host)

and calls `stop_telemetry()` after the server stopped (it flushes the spans still queued). The
cache service (cache_svc/server.py) is meant to do the same, and to wrap its client channels with
`hybridserve.telemetry.intercept_channel` on the worker side.
"""

from __future__ import annotations

from collections.abc import Callable

import grpc
from opentelemetry import trace
from prometheus_client import CollectorRegistry

from hybridserve import grpc_telemetry, metrics, telemetry

METRICS_PORT_HELP = "serve Prometheus /metrics on this port (-1 = off, 0 = a free port)"


def start_service_telemetry(service_name: str, metrics_port: int, metrics_host: str) -> Callable[[], None]:
    """Tracing from the OTEL_* environment, and the metrics endpoint when metrics_port >= 0.
    Returns the shutdown function (flushes spans)."""
    shutdown = telemetry.setup_tracing(service_name)
    if metrics_port >= 0:
        metrics.start_metrics_server(metrics_port, metrics_host)
    return shutdown


def server_interceptors(
    tracer_provider: trace.TracerProvider | None = None, registry: CollectorRegistry | None = None
) -> list[grpc.ServerInterceptor]:  # type: ignore[type-arg]
    """OpenTelemetry's tracing interceptor when tracing is on, the RPC metrics one when metrics are;
    none when both are off (an untraced process pays nothing)."""
    interceptors: list[grpc.ServerInterceptor] = []  # type: ignore[type-arg]
    if telemetry.tracing_enabled(tracer_provider):
        interceptors.append(grpc_telemetry.server_tracing_interceptor(telemetry.resolve(tracer_provider)))
    rpc = metrics.rpc_metrics(registry)
    if rpc is not None:
        interceptors.append(grpc_telemetry.ServerMetricsInterceptor(rpc))
    return interceptors
