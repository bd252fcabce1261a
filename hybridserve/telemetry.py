"""OpenTelemetry tracing for every service: the SDK set up once per process from the standard
OTEL_* variables; gRPC calls are traced by OpenTelemetry's gRPC instrumentation
(hybridserve/grpc_telemetry.py), which carries the W3C trace context over metadata.

Which exporter runs is chosen by OTEL_TRACES_EXPORTER (otlp, console, none; comma separated) and,
for otlp, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL / OTEL_EXPORTER_OTLP_PROTOCOL (grpc, http/protobuf).
Those selectors are read once by `TracingConfig.from_env` (the one place here that reads the
environment); everything else (endpoint, headers, batch delays, sampler, resource attributes) is
read by the SDK itself, as the OpenTelemetry specification says.

Unlike the SDK's own default, an unset OTEL_TRACES_EXPORTER means otlp only when an OTLP endpoint is
configured (OTEL_EXPORTER_OTLP_ENDPOINT or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), and none otherwise:
a stack started on a laptop without a collector must not log export failures every second.

Tracing off (OTEL_SDK_DISABLED=true, OTEL_TRACES_EXPORTER=none, or nothing configured) installs nothing: the global
provider stays the API's no-op one, `tracing_enabled()` is False and the interceptors are not added,
so an untraced process pays nothing.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import grpc
from opentelemetry import trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

from hybridserve.grpc_telemetry import traced_channel

log = logging.getLogger("hybridserve.telemetry")

__all__ = [
    "TracingConfig",
    "get_tracer",
    "intercept_channel",
    "setup_tracing",
    "tracing_enabled",
]

INSTRUMENTATION = "hybridserve"


@dataclass(frozen=True, slots=True)
class TracingConfig:
    """The exporter selectors of the OTEL_* environment, read once at start-up."""

    enabled: bool = False
    exporters: tuple[str, ...] = ()  # "otlp", "console"
    otlp_protocol: str = "grpc"  # "grpc" or "http/protobuf"

    @staticmethod
    def from_env(environ: Mapping[str, str] | None = None) -> TracingConfig:
        env = os.environ if environ is None else environ
        if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
            return TracingConfig()
        has_endpoint = bool(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))
        default = "otlp" if has_endpoint else "none"
        names = tuple(n.strip().lower() for n in env.get("OTEL_TRACES_EXPORTER", default).split(",") if n.strip())
        exporters = tuple(n for n in names if n != "none")
        protocol = env.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or env.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
        return TracingConfig(enabled=bool(exporters), exporters=exporters, otlp_protocol=protocol.strip().lower())


def _exporter(name: str, protocol: str) -> SpanExporter:
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        raise SystemExit(f"OTEL_TRACES_EXPORTER={name!r} is not supported; use otlp, console or none")
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcExporter

        return GrpcExporter()
    if protocol in ("http/protobuf", "http"):
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        return HttpExporter()
    raise SystemExit(f"OTLP protocol {protocol!r} is not supported; use grpc or http/protobuf")


def build_provider(service_name: str, config: TracingConfig) -> TracerProvider:
    """A provider with one batching processor per exporter. OTEL_SERVICE_NAME and
    OTEL_RESOURCE_ATTRIBUTES (read by the SDK) override the default service name."""
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "unknown_service")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: service_name}))
    provider = TracerProvider(resource=resource)
    for name in config.exporters:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name, config.otlp_protocol)))
    return provider


def setup_tracing(service_name: str, config: TracingConfig | None = None) -> Callable[[], None]:
    """Installs the global tracer provider for this process; returns the shutdown function that
    flushes spans still in the batch queues. A no-op (and nothing installed) when tracing is off."""
    config = TracingConfig.from_env() if config is None else config
    if not config.enabled:
        return lambda: None
    provider = build_provider(service_name, config)
    trace.set_tracer_provider(provider)
    log.info("tracing on: service %s, exporters %s", service_name, ",".join(config.exporters))

    def shutdown() -> None:
        provider.force_flush(5_000)
        provider.shutdown()

    return shutdown


def resolve(provider: trace.TracerProvider | None = None) -> trace.TracerProvider:
    return trace.get_tracer_provider() if provider is None else provider


def tracing_enabled(provider: trace.TracerProvider | None = None) -> bool:
    """Whether spans from this provider (default: the global one) go anywhere."""
    return isinstance(resolve(provider), TracerProvider)


def get_tracer(provider: trace.TracerProvider | None = None) -> trace.Tracer:
    return resolve(provider).get_tracer(INSTRUMENTATION)


def intercept_channel(channel: grpc.Channel, provider: trace.TracerProvider | None = None) -> grpc.Channel:
    """The channel, wrapped so each call gets a client span and carries its trace context; the
    channel itself when tracing is off. For every client of another service (scheduler, cache)."""
    if not tracing_enabled(provider):
        return channel
    return traced_channel(channel, resolve(provider))
