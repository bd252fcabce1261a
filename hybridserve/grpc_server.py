"""gRPC server plumbing shared by every service: one interceptor that maps domain errors to status
codes, health (`liveness`, `readiness`) and reflection on every server, port-0 binding, graceful
shutdown."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Iterator
from concurrent import futures
from typing import Any

import grpc
from google.protobuf import message_factory
from google.protobuf.descriptor import ServiceDescriptor
from google.protobuf.message import DecodeError
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from hybridserve import errors
from hybridserve.grpc_auth import BearerAuthInterceptor
from hybridserve.service_telemetry import server_interceptors
from hybridserve.tls import TlsSettings

log = logging.getLogger("hybridserve.grpc")

# Domain error -> status code. Anything else is a bug: INTERNAL with a log line and a traceback.
STATUS_OF: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (errors.InvalidArgumentError, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.ResourceExhaustedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.NotFoundError, grpc.StatusCode.NOT_FOUND),
    (errors.UnavailableError, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceededError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (errors.AbortedError, grpc.StatusCode.ABORTED),
)

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
DRAIN_HELP = (
    "on SIGTERM: readiness turns NOT_SERVING, new calls are refused (UNAVAILABLE) and calls in flight get"
    " this many seconds to finish; the rest are then cancelled"
)

Adder = Callable[[grpc.Server], str]  # registers one servicer, returns its full service name


def status_of(exc: BaseException) -> grpc.StatusCode:
    for kind, code in STATUS_OF:
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


class DomainErrorInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Turns a domain error raised by a servicer into its status code and logs the rejection, so
    servicers only convert, call and convert back."""

    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        handler = continuation(details)
        if handler is None:
            return None
        method = details.method
        if handler.unary_unary is not None:
            return handler._replace(unary_unary=_guard_unary(handler.unary_unary, method))
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=_guard_stream(handler.unary_stream, method))
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=_guard_unary(handler.stream_unary, method))
        if handler.stream_stream is not None:
            return handler._replace(stream_stream=_guard_stream(handler.stream_stream, method))
        return handler


class UndecodableRequest:
    """Stands in for a request whose bytes did not parse, so the caller gets INVALID_ARGUMENT
    (grpc's own deserializer failure would be INTERNAL)."""

    def __init__(self, type_name: str, error: str) -> None:
        self.type_name = type_name
        self.error = error


def _lenient_parser(message_class: Any) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return message_class.FromString(data)
        except (DecodeError, RuntimeWarning, ValueError) as exc:
            return UndecodableRequest(message_class.DESCRIPTOR.full_name, str(exc) or type(exc).__name__)

    return parse


def add_servicer(server: grpc.Server, service: ServiceDescriptor, servicer: Any) -> str:
    """Registers `servicer` (an object with one method per RPC) for a service descriptor; returns
    the full service name. Unlike the generated add_*_to_server, a request that does not parse
    becomes INVALID_ARGUMENT."""
    handlers: dict[str, grpc.RpcMethodHandler] = {}  # type: ignore[type-arg]
    for method in service.methods:
        in_class = message_factory.GetMessageClass(method.input_type)
        out_class = message_factory.GetMessageClass(method.output_type)
        kind = {
            (False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler,
        }[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=_lenient_parser(in_class),
            response_serializer=out_class.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service.full_name, handlers),))
    return service.full_name


def _check_decoded(request: Any) -> None:
    if isinstance(request, UndecodableRequest):
        raise errors.InvalidArgumentError(f"request is not a valid {request.type_name}: {request.error}")


def _abort(exc: Exception, context: grpc.ServicerContext, method: str) -> None:
    if context.code() is not None:  # type: ignore[attr-defined]  # aborted on purpose: keep its status
        raise exc
    code = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error in %s", method)
        context.abort(code, clip(f"internal error: {type(exc).__name__}: {exc}"))
    message = clip(str(exc))
    log.info("rejected %s: %s: %s", method, code.name, message)
    context.abort(code, message)


MAX_DETAILS_CHARS = 1024  # status details travel as metadata; clients refuse more than 8-16 KiB of it


def clip(message: str, limit: int = MAX_DETAILS_CHARS) -> str:
    """A message that echoes a caller's value (an id, a string) cut to `limit` characters, so a huge
    value neither floods the log nor makes the status itself too big for the client to read."""
    if len(message) <= limit:
        return message
    return f"{message[: limit - 40]}... ({len(message)} characters in all)"


def _guard_unary(behaviour: Callable[..., Any], method: str) -> Callable[..., Any]:
    def guarded(request: Any, context: grpc.ServicerContext) -> Any:
        try:
            _check_decoded(request)
            return behaviour(request, context)
        except Exception as exc:
            _abort(exc, context, method)

    return guarded


def _guard_stream(behaviour: Callable[..., Any], method: str) -> Callable[..., Any]:
    def guarded(request: Any, context: grpc.ServicerContext) -> Iterator[Any]:
        try:
            _check_decoded(request)
            yield from behaviour(request, context)
        except Exception as exc:
            _abort(exc, context, method)

    return guarded


LIVENESS = "liveness"  # the process can make progress; restart it if not
READINESS = "readiness"  # it can serve now (the empty name means the same)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Health(health.HealthServicer):
    """grpc.health.v1 with the two names every server reports (docs/design.md, The public contract): `liveness`, and
    `readiness`, which the empty name and each served service's name follow.

    Draining (graceful shutdown) ends readiness for good and keeps liveness: the process is still
    making progress, finishing the calls in flight."""

    def __init__(self, service_names: Iterable[str] = ()) -> None:
        super().__init__()
        self._ready_names = ["", READINESS, *service_names]
        self._draining = False
        self.set(LIVENESS, SERVING)
        self.set_ready(True)

    def set_ready(self, ready: bool) -> None:
        """Readiness (and "" and every service name): SERVING or NOT_SERVING; True is ignored
        once draining."""
        if ready and self._draining:
            return
        for name in self._ready_names:
            self.set(name, SERVING if ready else NOT_SERVING)

    def set_alive(self, alive: bool) -> None:
        self.set(LIVENESS, SERVING if alive else NOT_SERVING)

    def enter_graceful_shutdown(self) -> None:
        self._draining = True
        self.set_ready(False)


def watch_health(
    health_servicer: Health,
    is_alive: Callable[[], bool],
    is_ready: Callable[[], bool] = lambda: True,
    interval_s: float = 1.0,
) -> threading.Event:
    """Polls the probes every interval_s on a daemon thread and reports them (a process that is not
    alive is not ready either); set the returned event to stop."""
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            alive = is_alive()
            health_servicer.set_alive(alive)
            health_servicer.set_ready(alive and is_ready())
            stop.wait(interval_s)

    threading.Thread(target=poll, name="health", daemon=True).start()
    return stop


def create_server(
    adders: Iterable[Callable[[grpc.Server], str]],
    host: str = "127.0.0.1",
    port: int = 0,
    max_workers: int = 32,
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
    tracer_provider: Any = None,
    tls: TlsSettings | None = None,
    keys: frozenset[str] = frozenset(),
    keys_name: str = "API key",
) -> tuple[grpc.Server, int, Health]:
    """Builds a ready-to-start (not started) server with health (liveness, readiness; both SERVING
    until told otherwise) and reflection (unless tls.reflection is off).

    With `tls` serving a certificate the port is TLS (mTLS when it names a client CA); with `keys`
    every call but health and reflection needs `authorization: Bearer KEY` (`keys_name` says which
    credential in refusals).

    Each adder registers one servicer and returns its full service name. Port 0 picks a free port;
    the bound port is returned. Calls are traced (and counted) when this process has tracing (or a
    metrics endpoint) on; `tracer_provider` overrides the global provider (tests).
    """
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=[
            *server_interceptors(tracer_provider),
            *([BearerAuthInterceptor(keys, keys_name)] if keys else []),
            DomainErrorInterceptor(),
        ],
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.so_reuseport", 0),
        ],
    )
    names = [add(server) for add in adders]
    health_servicer = Health(names)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    if tls is None or tls.reflection:
        reflection.enable_server_reflection(
            [*names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server
        )
    credentials = tls.server_credentials() if tls is not None else None
    address = f"{_bracket(host)}:{port}"
    bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return server, bound, health_servicer


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def stop_on_signal() -> threading.Event:
    """An event that SIGTERM or SIGINT sets. Install it before announcing the port, so a signal sent
    as soon as the port is known is a graceful stop, not the default death."""
    stop = threading.Event()

    def handle(signum: int, _frame: Any) -> None:
        log.info("received %s, shutting down", signal.Signals(signum).name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, handle)
    return stop


def wait_for(event: threading.Event, poll_s: float = 0.5) -> None:
    """Blocks the main thread until `event` is set, waking every poll_s: a signal delivered to
    another thread only runs its Python handler once the main thread wakes, which an untimed wait
    may never do."""
    while not event.wait(poll_s):
        pass


def serve_until_signal(
    server: grpc.Server,
    health_servicer: Health,
    grace_s: float = 5.0,
    on_stop: Callable[[], None] | None = None,
    stop: threading.Event | None = None,
) -> None:
    """Blocks until SIGTERM or SIGINT (or `stop`, from stop_on_signal), then stops taking calls
    (readiness NOT_SERVING), lets calls in flight finish within grace_s, runs on_stop and returns."""
    wait_for(stop if stop is not None else stop_on_signal())
    health_servicer.enter_graceful_shutdown()
    server.stop(grace_s).wait()
    if on_stop is not None:
        on_stop()
    log.info("stopped")


def announce(host: str, port: int, what: str = "") -> None:
    """The line operators and tests read to find a server started with --port 0 (`what` names a second
    listener: "grpc"). One write of the whole line: print's separate write of the newline lets a log
    line from another thread (stderr, the same pipe under a parent) land between, and the reader then
    takes the log's digits for the port's."""
    sys.stdout.write(f"{what + ' ' if what else ''}listening on {host}:{port}\n")
    sys.stdout.flush()
