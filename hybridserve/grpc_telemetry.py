"""gRPC calls traced by OpenTelemetry's own gRPC instrumentation, plus the two things it lacks here.

`opentelemetry-instrumentation-grpc` opens a CLIENT span per call with the W3C trace context in the
call's metadata, and a SERVER span per call as the child of the caller's, with the `rpc.*`
attributes and the status code. What this module adds:

- span names as the OpenTelemetry RPC conventions write them, `package.Service/Method`: the
  instrumentation names spans after the full method path, `/package.Service/Method`;
- RPC metrics (latency, errors by status code) on the server side, which the instrumentation does
  not record.

Health checks and reflection are neither traced nor counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import client_interceptor, filters, server_interceptor
from opentelemetry.instrumentation.grpc.grpcext import intercept_channel

from hybridserve.metrics import RpcMetrics

UNTRACED_SERVICES = ("grpc.health.", "grpc.reflection.")


class _ConventionalNames(trace.Tracer):
    """A tracer that names spans `package.Service/Method` (drops the path's leading slash)."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def start_span(self, name: str, *args: Any, **kwargs: Any) -> trace.Span:
        return self._tracer.start_span(name.lstrip("/"), *args, **kwargs)

    def start_as_current_span(self, name: str, *args: Any, **kwargs: Any) -> Any:
        return self._tracer.start_as_current_span(name.lstrip("/"), *args, **kwargs)


class _ConventionalNamesProvider(trace.TracerProvider):
    def __init__(self, provider: trace.TracerProvider) -> None:
        self._provider = provider

    def get_tracer(self, *args: Any, **kwargs: Any) -> trace.Tracer:
        return _ConventionalNames(self._provider.get_tracer(*args, **kwargs))


def _traced(details: Any) -> bool:
    return not str(details.method).lstrip("/").startswith(UNTRACED_SERVICES)


def traced_channel(channel: grpc.Channel, provider: trace.TracerProvider) -> grpc.Channel:
    """The channel with the instrumentation's client interceptor: a span per call, its context sent."""
    interceptor = client_interceptor(tracer_provider=_ConventionalNamesProvider(provider))  # type: ignore[no-untyped-call]
    traced: grpc.Channel = intercept_channel(channel, interceptor)  # type: ignore[no-untyped-call]
    return traced


def server_tracing_interceptor(provider: trace.TracerProvider) -> grpc.ServerInterceptor:  # type: ignore[type-arg]
    """The instrumentation's server interceptor, skipping health checks and reflection."""
    interceptor: grpc.ServerInterceptor = server_interceptor(  # type: ignore[type-arg,no-untyped-call]
        tracer_provider=_ConventionalNamesProvider(provider),
        filter_=filters.negate(filters.any_of(*(filters.service_prefix(s) for s in UNTRACED_SERVICES))),
    )
    return interceptor


class ServerMetricsInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Latency and error counts per method and status code (unary and server-streaming calls)."""

    def __init__(self, metrics: RpcMetrics) -> None:
        self._metrics = metrics

    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None or not _traced(details):
            return handler
        method = details.method
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, method))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._stream(handler.unary_stream, method))
        return handler  # no client-streaming RPCs in the contract

    def _done(self, method: str, context: Any, failed: bool, started: float) -> None:
        code = context.code() or (grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK)
        self._metrics.observe("server", method, code.name, time.perf_counter() - started)

    def _unary(self, behaviour: Callable[..., Any], method: str) -> Callable[..., Any]:
        def counted(request: Any, context: grpc.ServicerContext) -> Any:
            started, failed = time.perf_counter(), True
            try:
                response = behaviour(request, context)
                failed = False
                return response
            finally:
                self._done(method, context, failed, started)

        return counted

    def _stream(self, behaviour: Callable[..., Any], method: str) -> Callable[..., Any]:
        def counted(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            started, failed = time.perf_counter(), True
            try:
                yield from behaviour(request, context)
                failed = False
            finally:
                self._done(method, context, failed, started)

        return counted
