"""The OpenAI HTTP API on aiohttp: /v1/completions, /v1/chat/completions (JSON or server-sent
events; one request's run against the workers is generation.py's), /v1/responses (responses_api.py),
/v1/models, and /health, /ready, /metrics.

Every error leaves as OpenAI's body shape with its status (api_errors.py). A client that disconnects
cancels its handler (the runner is built with handler_cancellation), which cancels the worker calls:
the worker aborts the request at once."""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from opentelemetry import propagate
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway import api_errors, tokenize_api
from gateway.api_errors import ApiError
from gateway.body import BodyParser
from gateway.chat_messages import Message
from gateway.chat_template import ChatPrompt, ChatTemplate
from gateway.dispatch import Dispatcher
from gateway.generation import Generation
from gateway.metrics import GatewayMetrics
from gateway.openai_request import TextLimits
from gateway.reasoning import pick_reasoning_parser
from gateway.tokens import GatewayTokenizer
from gateway.tool_calls import ToolRequest
from gateway.tool_parsers import pick_parser
from hybridserve import telemetry
from hybridserve.auth import is_authorized
from hybridserve.generation_config import GenerationDefaults

log = logging.getLogger("hybridserve.gateway.http")

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})


@dataclass
class Gateway:
    """Everything the handlers share; built once by server.py."""

    dispatcher: Dispatcher
    metrics: GatewayMetrics
    api_keys: frozenset[str]
    model_name: str  # served under this name ("" = the workers' GetInfo model)
    tokenizer: GatewayTokenizer | None
    chat_template: ChatTemplate | None
    request_timeout_s: float
    generation_defaults: GenerationDefaults = GenerationDefaults()  # the model's generation_config.json
    text_work: Executor | None = None  # template rendering and tokenizing, off the event loop (None: inline)
    bodies: BodyParser = field(default_factory=BodyParser)
    tool_parser: str = "auto"  # --tool-call-parser: a format of gateway/tool_parsers.py, or auto (the template's)
    reasoning_parser: str = "auto"  # --reasoning-parser: deepseek_r1, none, or auto (when the template writes <think>)
    allow_special_tokens_in_content: bool = False  # content's special-token text read as special tokens
    # where the tokenizer, template and defaults came from: "--model" (a folder here), "workers"
    # (GetModelFiles, gateway/model_files.py), "" (neither: no --model and no worker has sent them yet)
    files_source: str = "--model"

    def tool_format(self) -> str:
        """The tool-call format of the served model."""
        return pick_parser(self.tool_parser, self.chat_template.source if self.chat_template else None)

    def reasoning_format(self) -> str:
        """The reasoning parser ("" = none)."""
        return pick_reasoning_parser(self.reasoning_parser, self.chat_template.source if self.chat_template else None)

    def render_chat(
        self, messages: Sequence[Message], tools: ToolRequest | None, add_generation_prompt: bool = True
    ) -> ChatPrompt:
        """Messages (and the tools the model may call) through the chat template, content's special-token
        text kept literal unless --allow-special-tokens-in-content (the tokenizer's, wherever it came
        from: --model or the workers); the caller has checked that there is a template."""
        assert self.chat_template is not None
        literal = not self.allow_special_tokens_in_content and self.tokenizer is not None
        escape = self.tokenizer.special_token_texts if literal and self.tokenizer is not None else ()
        template_tools = tools.template_tools() if tools is not None else None
        return self.chat_template.render_prompt(
            messages, template_tools, escape, add_generation_prompt=add_generation_prompt
        )

    def missing_template_reason(self) -> str:
        """Why there is no chat template: this gateway has no model files at all, or the model has none."""
        if not self.files_source:
            return (
                "this gateway has no model folder (--model) and no worker has sent the model's files (GetModelFiles)"
                " yet, so it has no chat template; retry shortly, or start it with --model DIR or --chat-template FILE"
            )
        where = "the files the workers sent" if self.files_source == "workers" else "the --model folder"
        return (
            f"this model has no chat template (neither chat_template.jinja nor tokenizer_config.json's 'chat_template'"
            f" in {where}); use /v1/completions, or start the gateway with --chat-template FILE"
        )

    def missing_tokenizer_reason(self) -> str:
        if not self.files_source:
            return (
                "this gateway has no model folder (--model) and no worker has sent the model's files (GetModelFiles)"
                " yet, so it has no tokenizer; retry shortly, or start it with --model DIR|ORG/NAME"
            )
        return "this model has no tokenizer.json, so the gateway has no tokenizer; send token ids"

    def text_limits(self) -> TextLimits | None:
        """The served model's text limits; None without a tokenizer here or a ready worker's limit."""
        max_model_len = self.dispatcher.max_model_len()
        if self.tokenizer is None or max_model_len <= 0:
            return None
        return TextLimits(max_model_len, self.tokenizer.max_bytes_per_token)

    def served_model(self) -> str:
        if self.model_name:
            return self.model_name
        for worker in self.dispatcher.pool.workers.values():
            if worker.info is not None and worker.info.model:
                return str(worker.info.model)
        return ""


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


async def read_body(request: web.Request) -> bytes:
    """The body's bytes (decompressed when it says Content-Encoding: gzip, deflate or br): 413 past the
    size limit, 400 when it is not what its encoding says."""
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise api_errors.too_large(request.app["max_body_bytes"]) from None
    except web.HTTPException:
        raise
    except Exception as exc:  # aiohttp's decoders raise their library's errors on a corrupt body
        encoding = request.headers.get("Content-Encoding", "identity")
        raise api_errors.bad_request(
            f"the request body cannot be read as Content-Encoding {encoding!r}: {type(exc).__name__}: {exc}"
            "; send it as that encoding says, or without the header",
            code="invalid_encoding",
        ) from None


def _traced(gateway: Gateway, request: web.Request) -> Any:
    """The request's SERVER span, the root of its trace unless the client sent a traceparent."""
    return telemetry.get_tracer().start_as_current_span(
        f"{request.method} {request.path}",
        context=propagate.extract(dict(request.headers)),
        kind=SpanKind.SERVER,
        attributes={"http.request.method": request.method, "url.path": request.path},
        record_exception=False,
    )


def generation_handler(kind: str) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    async def handle(request: web.Request) -> web.StreamResponse:
        gateway: Gateway = request.app["gateway"]
        started_s = time.perf_counter()
        with _traced(gateway, request) as span:
            api = await gateway.bodies.parse(await read_body(request), kind, gateway.text_limits())
            served = gateway.served_model()
            if not served:  # no worker has answered yet, so the model's name is not known
                raise api_errors.unavailable("no worker is ready yet; retry shortly")
            if api.model != served:
                raise api_errors.not_found(
                    f"the model '{api.model}' does not exist; this server serves '{served}'", "model", "model_not_found"
                )
            span.set_attribute("gen_ai.request.model", api.model)
            span.set_attribute("gen_ai.operation.name", "chat" if kind == "chat" else "text_completion")
            gateway.metrics.in_flight.inc()
            try:
                generation = Generation(gateway, api, started_s)
                if api.stream:
                    return await generation.respond_stream(request)
                return await generation.respond_json()
            except ApiError as exc:
                span.set_status(Status(StatusCode.ERROR, exc.message))
                raise
            finally:
                gateway.metrics.in_flight.dec()

    return handle


async def list_models(request: web.Request) -> web.Response:
    gateway: Gateway = request.app["gateway"]
    served = gateway.served_model()
    max_model_len = gateway.dispatcher.max_model_len()  # the ready workers' smallest (vLLM's field)
    entry = {"id": served, "object": "model", "created": 0, "owned_by": "hybridserve", "max_model_len": max_model_len}
    models = [entry] if served else []
    name = request.match_info.get("model")
    if name is not None:
        if name != served:
            raise api_errors.not_found(f"the model '{name}' does not exist", "model", "model_not_found")
        return web.json_response(models[0])
    return web.json_response({"object": "list", "data": models})


async def health(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def ready(request: web.Request) -> web.Response:
    gateway: Gateway = request.app["gateway"]
    workers = gateway.dispatcher.pool.workers.values()
    body = {"ready": any(w.is_ready for w in workers), "workers": {w.address: w.is_ready for w in workers}}
    return web.json_response(body, status=200 if body["ready"] else 503)


async def metrics(request: web.Request) -> web.Response:
    gateway: Gateway = request.app["gateway"]
    gateway.metrics.workers_ready.set(len(gateway.dispatcher.pool.ready()))
    return web.Response(body=gateway.metrics.render(), content_type="text/plain", charset="utf-8")


@web.middleware
async def errors_and_auth(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Authentication, OpenAI-shaped errors for everything (including 404/405 of unknown routes), and
    the request counter."""
    gateway: Gateway = request.app["gateway"]
    route = request.match_info.route.resource.canonical if request.match_info.route.resource else "unmatched"
    try:
        if request.path not in OPEN_PATHS and not _authorized(gateway, request):
            raise api_errors.unauthorized("missing or wrong API key; send 'Authorization: Bearer KEY'")
        response = await handler(request)
    except ApiError as exc:
        response = error_response(exc)
    except web.HTTPException as exc:  # aiohttp's own: unknown path, wrong method, ...
        if exc.status < 400:
            raise
        response = error_response(
            ApiError(exc.status, f"{exc.reason}: {request.method} {request.path}", "invalid_request_error")
        )
    except Exception as exc:  # a bug: still OpenAI's shape, and a traceback in the log
        log.exception("internal error in %s %s", request.method, request.path)
        response = error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))
    gateway.metrics.finished(route, response.status)
    return response


def _authorized(gateway: Gateway, request: web.Request) -> bool:
    return is_authorized(gateway.api_keys, request.headers.get("Authorization"))


def build_app(gateway: Gateway, max_body_bytes: int) -> web.Application:
    app = web.Application(client_max_size=max_body_bytes, middlewares=[errors_and_auth])
    app["gateway"] = gateway
    app["max_body_bytes"] = max_body_bytes
    app.router.add_post("/v1/completions", generation_handler("completion"))
    app.router.add_post("/v1/chat/completions", generation_handler("chat"))
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", list_models)
    app.router.add_get("/health", health)
    app.router.add_get("/ready", ready)
    app.router.add_get("/metrics", metrics)
    tokenize_api.add_routes(app)
    from gateway import responses_api  # it imports this module (Gateway, the request helpers)

    responses_api.add_routes(app)
    return app
