"""gRPC interceptors that carry the W3C trace context (traceparent) over call metadata.

The client side opens a CLIENT span per call and injects its context into the metadata; the server
side extracts it and opens the SERVER span as its child, so a call's two halves join one trace
across processes. The server interceptor also feeds the RPC metrics (latency, errors by code).
Span names and attributes follow the OpenTelemetry RPC conventions (`rpc.system`, `rpc.service`,
`rpc.method`, `rpc.grpc.status_code`).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import grpc
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

if TYPE_CHECKING:
    from hybridserve.metrics import RpcMetrics


def rpc_attributes(method: str) -> dict[str, str]:
    """'/pkg.Service/Method' -> the rpc.* attributes."""
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": name}


def _finish(span: trace.Span, code: grpc.StatusCode, details: str | None = None) -> None:
    span.set_attribute("rpc.grpc.status_code", code.value[0])
    if code != grpc.StatusCode.OK:
        span.set_status(Status(StatusCode.ERROR, f"{code.name}: {details or ''}".rstrip(": ")))


class _CallDetails(
    collections.namedtuple(
        "_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready", "compression")
    ),
    grpc.ClientCallDetails,
):
    pass


def _with_context(details: grpc.ClientCallDetails) -> _CallDetails:
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    metadata = [*(details.metadata or ()), *carrier.items()]
    return _CallDetails(
        details.method,
        details.timeout,
        metadata,
        details.credentials,
        getattr(details, "wait_for_ready", None),
        getattr(details, "compression", None),
    )


class _TracedStream:
    """A server-streaming call whose client span ends when the stream does; everything else is
    delegated to the call (cancel, code, initial_metadata, ...)."""

    def __init__(self, call: Any, span: trace.Span) -> None:
        self._call = call
        self._span = span

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        try:
            return next(self._call)
        except StopIteration:
            self._end(grpc.StatusCode.OK)
            raise
        except grpc.RpcError as err:
            self._end(err.code(), err.details())
            raise

    def _end(self, code: grpc.StatusCode, details: str | None = None) -> None:
        if self._span.is_recording():
            _finish(self._span, code, details)
            self._span.end()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._call, name)


class ClientTracingInterceptor(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):  # type: ignore[type-arg]
    """One CLIENT span per call, a child of the caller's current span, its context injected into
    the call's metadata."""

    def __init__(self, tracer: trace.Tracer) -> None:
        self._tracer = tracer

    def intercept_unary_unary(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        name = details.method.lstrip("/")
        with self._tracer.start_as_current_span(
            name, kind=SpanKind.CLIENT, attributes=rpc_attributes(details.method), record_exception=False
        ) as span:
            outcome = continuation(_with_context(details), request)
            code = outcome.code()  # waits for the call to end
            _finish(span, code, outcome.details() if code != grpc.StatusCode.OK else None)
            return outcome

    def intercept_unary_stream(self, continuation: Callable[..., Any], details: Any, request: Any) -> Any:
        span = self._tracer.start_span(
            details.method.lstrip("/"), kind=SpanKind.CLIENT, attributes=rpc_attributes(details.method)
        )
        with trace.use_span(span, end_on_exit=False):
            call = continuation(_with_context(details), request)
        return _TracedStream(call, span)


class ServerTelemetryInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """A SERVER span per call (child of the caller's span from the metadata) when `tracer` is set,
    and latency and error counts per method and status code when `metrics` is set."""

    def __init__(self, tracer: trace.Tracer | None, metrics: RpcMetrics | None) -> None:
        self._tracer = tracer
        self._metrics = metrics

    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        if method.startswith(("/grpc.health.", "/grpc.reflection.")):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=self._unary(handler.unary_unary, method, metadata))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=self._stream(handler.unary_stream, method, metadata))
        return handler  # no client-streaming RPCs in the contract

    def _span(self, method: str, metadata: dict[str, Any]) -> Any:
        if self._tracer is None:
            return None
        return self._tracer.start_as_current_span(
            method.lstrip("/"),
            context=propagate.extract(metadata),
            kind=SpanKind.SERVER,
            attributes=rpc_attributes(method),
            record_exception=False,
            set_status_on_exception=False,
        )

    def _done(self, span: trace.Span | None, method: str, context: Any, failed: bool, started: float) -> None:
        code = context.code() or (grpc.StatusCode.UNKNOWN if failed else grpc.StatusCode.OK)
        if span is not None:
            _finish(span, code, context.details() if code != grpc.StatusCode.OK else None)
        if self._metrics is not None:
            self._metrics.observe("server", method, code.name, time.perf_counter() - started)

    def _unary(self, behaviour: Callable[..., Any], method: str, metadata: dict[str, Any]) -> Callable[..., Any]:
        def traced(request: Any, context: grpc.ServicerContext) -> Any:
            started, failed = time.perf_counter(), True
            manager = self._span(method, metadata)
            span = manager.__enter__() if manager is not None else None
            try:
                response = behaviour(request, context)
                failed = False
                return response
            finally:
                self._done(span, method, context, failed, started)
                if manager is not None:
                    manager.__exit__(None, None, None)

        return traced

    def _stream(self, behaviour: Callable[..., Any], method: str, metadata: dict[str, Any]) -> Callable[..., Any]:
        def traced(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
            started, failed = time.perf_counter(), True
            manager = self._span(method, metadata)
            span = manager.__enter__() if manager is not None else None
            try:
                yield from behaviour(request, context)
                failed = False
            finally:
                self._done(span, method, context, failed, started)
                if manager is not None:
                    manager.__exit__(None, None, None)

        return traced
