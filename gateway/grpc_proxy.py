"""The Generation gRPC API, proxied: a gRPC client needs only the gateway's address.

Generate is routed and retried as the HTTP API is (dispatch.py); a worker's own status (for example
INVALID_ARGUMENT) reaches the client unchanged. Abort goes to the worker serving that request id.
GetInfo answers with a ready worker's info, its load summed over all ready workers. The server
offers grpc.health.v1 (`liveness` while it runs; `readiness` while some worker is ready) and
reflection, as every server does.

A text prompt longer than the model can take is refused before it is tokenized, and tokenizing runs
on the text executor, never on the event loop. With API keys on, only the key that created a request
may abort it (any other gets NOT_FOUND, as for an id that is not live); with keys off anyone who can
reach the port may."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from concurrent.futures import Executor
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer  # grpc_health.v1.health.aio, importable by name
from grpc_reflection.v1alpha import reflection
from opentelemetry import propagate
from opentelemetry.trace import SpanKind

from gateway.dispatch import Dispatcher, NoWorkerError, UpstreamError
from gateway.metrics import GatewayMetrics
from gateway.openai_request import TextLimits
from gateway.tokens import GatewayTokenizer
from hybridserve import telemetry
from hybridserve.auth import bearer_token, is_authorized
from hybridserve.grpc_server import LIVENESS, READINESS
from hybridserve.tls import TlsSettings
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc

log = logging.getLogger("hybridserve.gateway.grpc")

_FORWARDED_METADATA = ("traceparent", "tracestate", "baggage")


class GenerationProxy(pb_grpc.GenerationServicer):
    def __init__(
        self,
        dispatcher: Dispatcher,
        metrics: GatewayMetrics,
        api_keys: frozenset[str],
        tokenizer: GatewayTokenizer | None,
        timeout_s: float,
        text_work: Executor | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.api_keys = api_keys
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.text_work = text_work  # tokenizing, off the event loop (None: inline)

    async def _check_key(self, context: grpc.aio.ServicerContext[Any, Any]) -> dict[str, str]:
        metadata = {k: v for k, v in (context.invocation_metadata() or ()) if isinstance(v, str)}
        if not is_authorized(self.api_keys, metadata.get("authorization")):
            await context.abort(
                grpc.StatusCode.UNAUTHENTICATED, "missing or wrong API key; send authorization: Bearer KEY"
            )
        return metadata

    def _owner(self, metadata: dict[str, str]) -> str | None:
        """The key a call was made with (None when keys are off: every caller is trusted alike)."""
        return bearer_token(metadata.get("authorization")) if self.api_keys else None

    def _text_limits(self) -> TextLimits | None:
        max_model_len = self.dispatcher.max_model_len()
        if self.tokenizer is None or max_model_len <= 0:
            return None
        return TextLimits(max_model_len, self.tokenizer.max_bytes_per_token)

    async def _prompt(
        self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> list[int] | str:
        """The prompt as routing sees it: token ids when known (sent, or tokenized here), else text."""
        if request.WhichOneof("input") == "prompt_token_ids":
            return list(request.prompt_token_ids.ids)
        tokenizer, limits = self.tokenizer, self._text_limits()
        if tokenizer is None:
            return request.prompt
        text = request.prompt
        if limits is not None and len(text) > limits.max_text_bytes:  # characters: at least one byte each
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                f"the prompt is {len(text)} characters; this server takes at most {limits.max_model_len} tokens,"
                f" so at most {limits.max_text_bytes} bytes of text ({limits.max_bytes_per_token} bytes per token"
                " at most with this tokenizer); shorten the prompt",
            )
        specials = request.add_special_tokens if request.HasField("add_special_tokens") else True
        if self.text_work is None:
            return tokenizer.encode(text, add_special_tokens=specials)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.text_work, lambda: tokenizer.encode(text, add_special_tokens=specials))

    async def Generate(self, request: pb.GenerateRequest, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        metadata = await self._check_key(context)
        remaining = context.time_remaining()
        timeout_s = self.timeout_s if remaining is None else min(remaining, self.timeout_s)
        tracer = telemetry.get_tracer()
        with tracer.start_as_current_span(
            "hybridserve.v1.Generation/Generate", context=propagate.extract(metadata), kind=SpanKind.SERVER
        ):
            carrier: dict[str, str] = {}
            propagate.inject(carrier)
            prompt = await self._prompt(request, context)
            prefix = self.dispatcher.prefix_hashes(prompt, request.cache_salt)
            owner = self._owner(metadata)
            stream = self.dispatcher.generate(request, prefix, len(prompt), list(carrier.items()), timeout_s, owner)
            status = "OK"
            try:
                async with contextlib.aclosing(stream):
                    async for message in stream:
                        yield message
            except UpstreamError as exc:
                status = exc.code.name
                await context.abort(exc.code, exc.details if not exc.after_first_message else str(exc))
            except NoWorkerError as exc:
                status = "UNAVAILABLE"
                await context.abort(grpc.StatusCode.UNAVAILABLE, f"no worker can serve this request now: {exc}")
            finally:
                self.metrics.finished("grpc Generate", status)

    async def Abort(self, request: pb.AbortRequest, context: grpc.aio.ServicerContext[Any, Any]) -> pb.AbortResponse:
        owner = self._owner(await self._check_key(context))
        route = self.dispatcher.live.get(request.request_id)
        if route is not None and not _may_abort(owner, route.owner):
            route = None  # another key's request: as if it did not exist
        worker = self.dispatcher.pool.workers.get(route.address) if route is not None else None
        if worker is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no live request with id {request.request_id!r}")
        assert worker is not None
        try:
            response: pb.AbortResponse = await worker.stub.Abort(
                request, timeout=5.0, metadata=self.dispatcher.pool.metadata
            )
            return response
        except grpc.aio.AioRpcError as exc:
            await context.abort(exc.code(), exc.details() or "")
            raise

    async def GetInfo(
        self, request: pb.GetInfoRequest, context: grpc.aio.ServicerContext[Any, Any]
    ) -> pb.GetInfoResponse:
        await self._check_key(context)
        ready = [w for w in self.dispatcher.pool.ready() if w.info is not None]
        if not ready:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "no worker is ready")
        info = pb.GetInfoResponse()
        assert ready[0].info is not None
        info.CopyFrom(ready[0].info)
        info.num_running = sum(w.info.num_running for w in ready if w.info is not None)
        info.num_waiting = sum(w.info.num_waiting for w in ready if w.info is not None)
        return info


def _may_abort(caller: str | None, owner: str | None) -> bool:
    """True when keys are off (no owner recorded) or the caller holds the key that created the request."""
    return owner is None or (caller is not None and hmac.compare_digest(caller.encode(), owner.encode()))


async def watch_readiness(dispatcher: Dispatcher, servicer: HealthServicer, interval_s: float) -> None:
    """The gateway is live (grpc.health.v1 `liveness`) while this runs, and ready (`readiness`, the
    empty name) while at least one worker is."""
    await servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
    last = None
    while True:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if dispatcher.pool.ready()
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        if status != last:
            for name in ("", READINESS, pb.DESCRIPTOR.services_by_name["Generation"].full_name):
                await servicer.set(name, status)
            last = status
        await asyncio.sleep(interval_s)


def create_grpc_server(
    proxy: GenerationProxy, host: str, port: int, tls: TlsSettings | None = None
) -> tuple[grpc.aio.Server, int, HealthServicer]:
    """The proxied Generation API with health and (unless tls.reflection is off) reflection; TLS (mTLS
    with a client CA) when tls serves a certificate."""
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    pb_grpc.add_GenerationServicer_to_server(proxy, server)  # type: ignore[no-untyped-call]
    health_servicer = HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [
        pb.DESCRIPTOR.services_by_name["Generation"].full_name,
        health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
        reflection.SERVICE_NAME,
    ]
    if tls is None or tls.reflection:
        reflection.enable_server_reflection(names, server)
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    credentials = tls.server_credentials() if tls is not None else None
    bound = server.add_insecure_port(address) if credentials is None else server.add_secure_port(address, credentials)
    if bound == 0:
        raise OSError(f"cannot bind {host}:{port}")
    return server, bound, health_servicer
