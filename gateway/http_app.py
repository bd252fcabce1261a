"""The OpenAI HTTP API on aiohttp: /v1/completions, /v1/chat/completions (JSON or server-sent
events), /v1/responses (responses_api.py), /v1/models, and /health, /ready, /metrics.

Every error leaves as OpenAI's body shape with its status (api_errors.py). A client that disconnects
cancels its handler (the runner is built with handler_cancellation), which cancels the worker calls:
the worker aborts the request at once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

import grpc
from aiohttp import web
from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from gateway import api_errors, tokenize_api
from gateway.api_errors import ApiError
from gateway.body import BodyParser
from gateway.chat_output import OutputParser
from gateway.chat_template import ChatPrompt, ChatTemplate
from gateway.convert import generate_requests
from gateway.dispatch import Dispatcher, NoWorkerError, UpstreamError
from gateway.echo import echo_of
from gateway.metrics import GatewayMetrics
from gateway.openai_request import ApiRequest, Message, TextLimits, check_text_size
from gateway.openai_response import ChoiceState, ChunkFrame, envelope, final_body, new_id, request_usage
from gateway.reasoning import ReasoningSplitter, pick_reasoning_parser, prompt_opens_reasoning
from gateway.tokens import GatewayTokenizer, token_id_text
from gateway.tool_calls import ToolRequest
from gateway.tool_constraint import tool_constraint
from gateway.tool_parsers import make_parser, pick_parser
from hybridserve import telemetry
from hybridserve.auth import is_authorized
from hybridserve.generation_config import GenerationDefaults
from hybridserve.v1 import generation_pb2 as pb

log = logging.getLogger("hybridserve.gateway.http")

OPEN_PATHS = frozenset({"/health", "/ready", "/metrics"})
_DONE = object()  # a choice's stream ended


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


def upstream_to_api(exc: UpstreamError | NoWorkerError) -> ApiError:
    """A worker's (or the router's) failure as the client sees it."""
    if isinstance(exc, NoWorkerError):
        return api_errors.unavailable(f"no worker can serve this request now: {exc}")
    if exc.code == grpc.StatusCode.INVALID_ARGUMENT:
        return api_errors.bad_request(exc.details)
    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return api_errors.overloaded(f"every worker's queue is full; retry later ({exc.details})")
    if exc.after_first_message:
        return api_errors.upstream_failed(f"the worker serving this request failed during generation: {exc}")
    return api_errors.unavailable(f"no worker could serve this request: {exc}")


def error_response(error: ApiError) -> web.Response:
    return web.json_response(error.body(), status=error.status)


def _sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


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


class Generation:
    """One /v1/completions or /v1/chat/completions request: n choices, each a worker call."""

    def __init__(self, gateway: Gateway, api: ApiRequest, started_s: float) -> None:
        self.gateway = gateway
        self.api = api
        self.started_s = started_s
        self.response_id = new_id(api.kind)
        self.model = api.model
        token_text = gateway.tokenizer.token_text if gateway.tokenizer is not None else token_id_text
        # completions: `logprobs: k` asks for k alternatives per token (0 too); chat: top_logprobs
        with_top = api.logprobs if api.kind == "completion" else api.top_logprobs > 0
        num_choices = len(api.all_prompts) * api.n  # prompt i's choices are i*n .. i*n+n-1
        self.choices = [ChoiceState(i, api.kind, api.logprobs, with_top, token_text) for i in range(num_choices)]
        self.first_token = False
        self.prompt_tokens_of: dict[int, int] = {}  # choice index -> its prompt's tokens, once tokenized
        self.tool_output: pb.StructuredOutput | None = None  # forced tool calls' constraint, set with the prompt
        self.clock = gateway.metrics.clock(api.model, started_s)  # TTFT, ITL, E2E of this request

    async def prompts_off_loop(self) -> list[str | tuple[int, ...] | list[int]]:
        """`prompts()` on the gateway's text executor: rendering and tokenizing never hold the event loop."""
        if self.gateway.text_work is None:
            return self.prompts()
        return await asyncio.get_running_loop().run_in_executor(self.gateway.text_work, self.prompts)

    def prompts(self) -> list[str | tuple[int, ...] | list[int]]:
        """What each prompt of the request is sent as (a chat has one)."""
        if self.api.kind == "chat":
            return [self.prompt()]
        return [self.prompt(p) for p in self.api.all_prompts]

    def prompt(self, raw: str | tuple[int, ...] | None = None) -> str | tuple[int, ...] | list[int]:
        """One prompt as sent to the workers: a chat rendered through the template; text tokenized here
        when the gateway has the tokenizer (`raw`: a completions prompt, else the request's first)."""
        api, gateway = self.api, self.gateway
        text = api.prompt if raw is None else raw
        if api.kind == "chat":
            if gateway.chat_template is None:
                raise api_errors.bad_request(gateway.missing_template_reason(), "messages", "no_chat_template")
            # checked by the grammar engine here, on the text threads (gateway/tool_constraint.py)
            self.tool_output = tool_constraint(api.tools, gateway.tool_format())
            chat = gateway.render_chat(api.messages, api.tools)
            if (limits := gateway.text_limits()) is not None:  # the template adds text of its own
                check_text_size([chat.text], "messages", limits)
            self.attach_parsers(chat)
            if gateway.tokenizer is not None:  # a rendered template holds its specials
                return gateway.tokenizer.encode_chat(chat)
            return chat.text
        if isinstance(text, str) and gateway.tokenizer is not None:
            return gateway.tokenizer.encode(text, add_special_tokens=True)
        return text

    def attach_parsers(self, chat: ChatPrompt) -> None:
        """Each choice's output parsers: reasoning (when the model writes it) and tool calls (when the
        request offers tools the model may call)."""
        reasoning = self.gateway.reasoning_format()
        tools = self.api.tools if self.api.tools is not None and self.api.tools.choice != "none" else None
        if not reasoning and tools is None:
            return
        starts_inside = prompt_opens_reasoning(chat.text)
        for choice in self.choices:
            choice.output = OutputParser(
                ReasoningSplitter(starts_inside) if reasoning else None,
                make_parser(self.gateway.tool_format()) if tools is not None else None,
                tools.parallel if tools is not None else True,
            )

    def requests(self, prompt: str | tuple[int, ...] | list[int]) -> list[pb.GenerateRequest]:
        """The worker requests of the choices; forced tool calls constrained (gateway/tool_constraint.py)."""
        requests = generate_requests(self.api, prompt, self.gateway.generation_defaults)
        if self.tool_output is not None:
            for request in requests:
                request.sampling.structured_output.CopyFrom(self.tool_output)
        return requests

    async def run_choice(
        self,
        request: pb.GenerateRequest,
        prefix: tuple[int, ...],
        num_prompt_tokens: int,
        queue: asyncio.Queue[Any],
        index: int,
        metadata: list[tuple[str, str]],
    ) -> None:
        try:
            stream = self.gateway.dispatcher.generate(
                request, prefix, num_prompt_tokens, metadata, self.gateway.request_timeout_s
            )
            async with contextlib.aclosing(stream):
                async for message in stream:
                    await queue.put((index, message))
            await queue.put((index, _DONE))
        except (UpstreamError, NoWorkerError) as exc:
            await queue.put((index, exc))

    async def events(self) -> Any:
        """Lists of (choice index, worker message) pairs from all choices: each list what had
        arrived when the previous one was taken (one pair while the client keeps up); raises
        ApiError after the pairs that came before the failure."""
        prompts = await self.prompts_off_loop()
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        queue: asyncio.Queue[Any] = asyncio.Queue()
        tasks = []
        raws = self.api.all_prompts if self.api.kind == "completion" else (self.api.prompt,)
        for p, (prompt, raw) in enumerate(zip(prompts, raws, strict=True)):
            prefix = self.gateway.dispatcher.prefix_hashes(prompt, self.api.cache_salt)
            for j, r in enumerate(self.requests(prompt)):
                index = p * self.api.n + j
                self.prompt_tokens_of[index] = len(prompt)
                self.choices[index].echo = echo_of(self.api, raw, prompt, self.gateway.tokenizer)
                tasks.append(
                    asyncio.create_task(self.run_choice(r, prefix, len(prompt), queue, index, list(carrier.items())))
                )
        remaining = len(tasks)
        try:
            while remaining:
                batch: list[tuple[int, pb.GenerateResponse]] = []
                ended: list[int] = []  # choices whose stream ended: checked once the batch was applied
                error: ApiError | None = None
                index, item = await queue.get()
                while True:
                    if item is _DONE:
                        remaining -= 1
                        ended.append(index)
                    elif isinstance(item, UpstreamError | NoWorkerError):
                        error = upstream_to_api(item)
                    else:
                        self.first_token = True
                        self.clock.tokens(len(item.token_ids))
                        batch.append((index, item))
                    if error is not None or queue.empty():
                        break
                    index, item = queue.get_nowait()
                if batch:
                    yield batch
                if error is not None:
                    raise error
                if any(self.choices[i].finish_reason is None for i in ended):
                    raise api_errors.upstream_failed("the worker aborted this request before it finished")
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def sse_with_usage(self, frame: ChunkFrame, choice: ChoiceState, message: pb.GenerateResponse) -> bytes:
        """The chunks of one worker message, each with its choice's usage so far (continuous_usage_stats)."""
        entries = choice.entries(message)
        prompt_tokens = self.prompt_tokens_of.get(choice.index, 0)
        return b"".join([frame.sse_with_usage(e, prompt_tokens, choice.num_tokens) for e in entries])

    def record_usage(self) -> dict[str, Any]:
        usage = request_usage(self.choices, self.api.n)
        reason = next((c.finish_reason for c in self.choices if c.finish_reason), "")
        self.clock.finished(reason, usage.prompt_tokens, usage.cached_tokens, usage.completion_tokens)
        span = trace.get_current_span()
        span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
        span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
        span.set_attribute("hybridserve.cached_tokens", usage.cached_tokens)
        return usage.to_json()

    async def respond_json(self) -> web.Response:
        async with contextlib.aclosing(self.events()) as events:
            async for batch in events:
                for index, message in batch:
                    self.choices[index].apply(message)
        body = final_body(self.api.kind, self.response_id, self.model, self.choices, self.api.n)
        self.record_usage()
        return web.json_response(body)

    async def respond_stream(self, request: web.Request) -> web.StreamResponse:
        response: web.StreamResponse | None = None
        created = int(time.time())
        frame = ChunkFrame.of(self.api.kind, self.response_id, self.model, created, self.api.include_usage)
        choices = self.choices
        async with contextlib.aclosing(self.events()) as events:
            try:
                async for batch in events:
                    if self.api.continuous_usage:
                        data = b"".join([self.sse_with_usage(frame, choices[i], m) for i, m in batch])
                    else:
                        data = b"".join(
                            [frame.sse(entry) for index, message in batch for entry in choices[index].entries(message)]
                        )
                    if response is None:  # errors before the first token still get their HTTP status
                        response = web.StreamResponse(
                            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                        )
                        await response.prepare(request)
                    await response.write(data)  # what arrived meanwhile: one write
            except ApiError as exc:
                if response is None:
                    raise
                log.warning("stream %s ended with an error: %s", self.response_id, exc.message)
                await response.write(_sse(exc.body()))
                return response
        assert response is not None  # a finished choice sent at least its last message
        if self.api.include_usage:
            chunk = envelope(self.api.kind, self.response_id, self.model, created, chunk=True)
            chunk["choices"] = []
            chunk["usage"] = self.record_usage()
            await response.write(_sse(chunk))
        else:
            self.record_usage()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


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
    from gateway import responses_api  # it builds on this module's Generation

    responses_api.add_routes(app)
    return app
