"""The gRPC side of hybridserve.auth: the one server interceptor that checks bearer credentials and
the one client interceptor that sends them. Health and reflection stay open (probes carry no
credentials); a refusal is logged with the method and the peer, never the credential."""

from __future__ import annotations

import collections
import logging
from collections.abc import Callable, Iterable
from typing import Any

import grpc

from hybridserve.auth import AUTHORIZATION, check_bearer

log = logging.getLogger("hybridserve.auth")

OPEN_SERVICES = ("/grpc.health.v1.Health/", "/grpc.reflection.v1alpha.ServerReflection/",
                 "/grpc.reflection.v1.ServerReflection/")  # fmt: skip


def _header_of(metadata: Iterable[tuple[str, Any]] | None) -> str | None:
    for key, value in metadata or ():
        if key == AUTHORIZATION and isinstance(value, str):
            return value
    return None


class BearerAuthInterceptor(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses every call outside OPEN_SERVICES that lacks one of `keys` (`what` names them in logs)."""

    def __init__(self, keys: frozenset[str], what: str = "API key") -> None:
        if not keys:
            raise ValueError("BearerAuthInterceptor needs at least one key")
        self.keys = keys
        self.what = what
        self.num_refused: collections.Counter[str] = collections.Counter()  # by status name

    def intercept_service(self, continuation: Callable[..., Any], details: Any) -> Any:
        method = details.method
        if method.startswith(OPEN_SERVICES):
            return continuation(details)
        refusal = check_bearer(self.keys, _header_of(details.invocation_metadata))
        if refusal is None:
            return continuation(details)
        code, message = grpc.StatusCode[refusal[0]], refusal[1]
        self.num_refused[code.name] += 1
        handler = continuation(details)
        if handler is None:
            return None

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            log.warning("refused %s from %s: %s (%s)", method, context.peer(), code.name, self.what)
            context.abort(code, f"{self.what}: {message}")

        def refuse_stream(request: Any, context: grpc.ServicerContext) -> Any:
            refuse(request, context)
            yield  # pragma: no cover  (abort raised)

        if handler.unary_unary is not None:
            return handler._replace(unary_unary=refuse)
        if handler.unary_stream is not None:
            return handler._replace(unary_stream=refuse_stream)
        if handler.stream_unary is not None:
            return handler._replace(stream_unary=refuse)
        return handler._replace(stream_stream=refuse_stream)


class _ClientCallDetails(grpc.ClientCallDetails):
    def __init__(self, base: grpc.ClientCallDetails, metadata: list[tuple[str, str | bytes]]) -> None:
        self.method = base.method
        self.timeout = base.timeout
        self.metadata = tuple(metadata)
        self.credentials = base.credentials
        self.wait_for_ready = getattr(base, "wait_for_ready", None)
        self.compression = getattr(base, "compression", None)


class BearerClientInterceptor(
    grpc.UnaryUnaryClientInterceptor,  # type: ignore[type-arg]
    grpc.UnaryStreamClientInterceptor,  # type: ignore[type-arg]
):
    """Adds `authorization: Bearer TOKEN` to every call on a channel."""

    def __init__(self, token: str) -> None:
        self._header: tuple[str, str | bytes] = (AUTHORIZATION, f"Bearer {token}")

    def _details(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [m for m in (details.metadata or ()) if m[0] != AUTHORIZATION]
        return _ClientCallDetails(details, [*metadata, self._header])

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)


def with_bearer(channel: grpc.Channel, token: str | None) -> grpc.Channel:
    """The channel, sending `token` on every call (the channel itself when there is none)."""
    return channel if not token else grpc.intercept_channel(channel, BearerClientInterceptor(token))
