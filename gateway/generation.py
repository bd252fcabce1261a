"""One /v1/completions or /v1/chat/completions request against the workers (`Generation`): its prompt
(chat rendered through the template, tool calls' constraint and output parsers set up), one worker call
per choice (prompts x n), and the OpenAI body or server-sent event stream made of their messages; and how
a worker's failure reaches the client (`upstream_to_api`). The routes that run it are in http_app.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

import grpc
from aiohttp import web
from opentelemetry import propagate, trace

from gateway import api_errors
from gateway.api_errors import ApiError
from gateway.chat_output import OutputParser
from gateway.chat_template import ChatPrompt
from gateway.convert import generate_requests
from gateway.dispatch import NoWorkerError, UpstreamError
from gateway.echo import echo_of
from gateway.openai_request import ApiRequest, check_text_size
from gateway.openai_response import ChoiceState, ChunkFrame, envelope, final_body, new_id, request_usage
from gateway.reasoning import ReasoningSplitter, prompt_opens_reasoning
from gateway.tokens import token_id_text
from gateway.tool_constraint import tool_constraint
from gateway.tool_parsers import make_parser
from hybridserve.v1 import generation_pb2 as pb

if TYPE_CHECKING:
    from gateway.http_app import Gateway

log = logging.getLogger("hybridserve.gateway.http")

_DONE = object()  # a choice's stream ended


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


def _sse(data: Any) -> bytes:
    return b"data: " + json.dumps(data, separators=(",", ":")).encode() + b"\n\n"


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
