"""POST /v1/responses: OpenAI's Responses API on the chat machinery (render, generate, parse).

The request runs as a chat request (responses_request.py); the choice's parsed output (reasoning, content
and tool calls, gateway/chat_output.py) becomes the `output` items: `reasoning`, `message` (one
`output_text` part) and `function_call` items, in the order the model wrote them. Streamed, the same
items arrive as the Responses event sequence: `response.created`, `response.in_progress`, then per item
`response.output_item.added`, its deltas (`response.output_text.delta`, `response.reasoning_text.delta`,
`response.function_call_arguments.delta`), its `...done` events and `response.output_item.done`, and last
`response.completed` (or `response.incomplete` when the token budget ran out)."""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from gateway import api_errors
from gateway.api_errors import ApiError
from gateway.generation import Generation
from gateway.http_app import Gateway, _traced, read_body
from gateway.openai_request import check_prompt_size
from gateway.openai_response import UsageCount
from gateway.responses_request import ResponsesRequest, parse_responses
from gateway.tool_parsers import Piece

log = logging.getLogger("hybridserve.gateway.responses")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage_json(usage: UsageCount) -> dict[str, Any]:
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


class ResponseBuilder:
    """Output items from pieces as they come, and the events that announce them (kept in `events`
    for a stream, dropped for a body)."""

    def __init__(self, request: ResponsesRequest, model: str, streaming: bool) -> None:
        self.request = request
        self.response_id = _id("resp")
        self.model = model
        self.created_at = int(time.time())
        self.streaming = streaming
        self.sequence = 0
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.items: list[dict[str, Any]] = []  # finished items
        self.open: dict[str, Any] | None = None  # the item being written

    def body(self, status: str, usage: UsageCount | None = None, incomplete: str | None = None) -> dict[str, Any]:
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "error": None,
            "incomplete_details": {"reason": incomplete} if incomplete else None,
            "model": self.model,
            "output": list(self.items),
            "previous_response_id": None,
            "reasoning": None,
            "store": False,
            "text": {"format": {"type": "text"}},
            "truncation": "disabled",
            "usage": usage_json(usage) if usage is not None else None,
            **self.request.echo,
        }

    def emit(self, kind: str, **data: Any) -> None:
        if self.streaming:
            self.events.append((kind, {"type": kind, "sequence_number": self.sequence, **data}))
            self.sequence += 1

    def start(self) -> None:
        self.emit("response.created", response=self.body("in_progress"))
        self.emit("response.in_progress", response=self.body("in_progress"))

    def add(self, piece: Piece) -> None:
        if piece.kind == "call":
            self.close()
            call = piece.call
            assert call is not None
            item = {"type": "function_call", "id": _id("fc"), "call_id": call.id, "name": call.name, "arguments": ""}
            where = {"item_id": item["id"], "output_index": len(self.items)}
            self.emit("response.output_item.added", output_index=len(self.items), item=item | {"status": "in_progress"})
            self.emit("response.function_call_arguments.delta", **where, delta=call.arguments)
            self.emit("response.function_call_arguments.done", **where, name=call.name, arguments=call.arguments)
            item = item | {"arguments": call.arguments, "status": "completed"}
            self.emit("response.output_item.done", output_index=len(self.items), item=item)
            self.items.append(item)
            return
        kind = "message" if piece.kind == "content" else "reasoning"
        if self.open is None or self.open["type"] != kind:
            self.close()
            self._open(kind)
        assert self.open is not None
        part = self.open["content"][0]
        part["text"] += piece.text
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        self.emit(
            delta, item_id=self.open["id"], output_index=len(self.items), content_index=0, delta=piece.text, **extra
        )

    def _open(self, kind: str) -> None:
        if kind == "message":
            item = {"type": "message", "id": _id("msg"), "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"type": "reasoning", "id": _id("rs"), "summary": [], "content": []}
            part = {"type": "reasoning_text", "text": ""}
        self.emit("response.output_item.added", output_index=len(self.items), item=item)
        self.open = item | {"content": [dict(part)]}
        if kind == "message":
            where = {"item_id": item["id"], "output_index": len(self.items), "content_index": 0}
            self.emit("response.content_part.added", **where, part=part)

    def close(self) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": len(self.items), "content_index": 0}
        if item["type"] == "message":
            item["status"] = "completed"
            self.emit("response.output_text.done", **where, text=part["text"], logprobs=[])
            self.emit("response.content_part.done", **where, part=part)
        else:
            self.emit("response.reasoning_text.done", **where, text=part["text"])
        self.emit("response.output_item.done", output_index=len(self.items), item=item)
        self.items.append(item)

    def finish(self, usage: UsageCount, finish_reason: str | None) -> dict[str, Any]:
        self.close()
        incomplete = "max_output_tokens" if finish_reason == "length" else None
        body = self.body("incomplete" if incomplete else "completed", usage, incomplete)
        self.emit("response.incomplete" if incomplete else "response.completed", response=body)
        return body

    def take_events(self) -> bytes:
        events, self.events = self.events, []
        return b"".join(
            f"event: {kind}\ndata: {json.dumps(data, separators=(',', ':'))}\n\n".encode() for kind, data in events
        )


def new_pieces(generation: Generation, index: int, message: Any, seen: int) -> tuple[list[Piece], int]:
    """Applies a worker message to the choice; returns the pieces it added and the new count."""
    choice = generation.choices[index]
    choice.apply(message)
    if choice.output is None:
        return ([Piece("content", message.text)] if message.text else []), seen
    return choice.output.pieces[seen:], len(choice.output.pieces)


async def handle(request: web.Request) -> web.StreamResponse:
    gateway: Gateway = request.app["gateway"]
    started_s = time.perf_counter()
    with _traced(gateway, request) as span:
        parsed = parse_responses(await gateway.bodies.decode(await read_body(request)))
        api = parsed.api
        if (limits := gateway.text_limits()) is not None:
            check_prompt_size(api, limits)
        served = gateway.served_model()
        if not served:
            raise api_errors.unavailable("no worker is ready yet; retry shortly")
        if api.model != served:
            raise api_errors.not_found(
                f"the model '{api.model}' does not exist; this server serves '{served}'", "model", "model_not_found"
            )
        span.set_attribute("gen_ai.request.model", api.model)
        span.set_attribute("gen_ai.operation.name", "chat")
        gateway.metrics.in_flight.inc()
        try:
            generation = Generation(gateway, api, started_s)
            builder = ResponseBuilder(parsed, api.model, api.stream)
            return await (_stream(generation, builder, request) if api.stream else _json(generation, builder))
        finally:
            gateway.metrics.in_flight.dec()


async def _json(generation: Generation, builder: ResponseBuilder) -> web.Response:
    seen = 0
    async with contextlib.aclosing(generation.events()) as events:
        async for batch in events:
            for index, message in batch:
                pieces, seen = new_pieces(generation, index, message, seen)
                for piece in pieces:
                    builder.add(piece)
    generation.record_usage()
    choice = generation.choices[0]
    return web.json_response(builder.finish(choice.usage or UsageCount(), choice.finish_reason))


async def _stream(generation: Generation, builder: ResponseBuilder, request: web.Request) -> web.StreamResponse:
    response: web.StreamResponse | None = None
    seen = 0
    builder.start()
    async with contextlib.aclosing(generation.events()) as events:
        try:
            async for batch in events:
                for index, message in batch:
                    pieces, seen = new_pieces(generation, index, message, seen)
                    for piece in pieces:
                        builder.add(piece)
                if response is None:  # errors before the first token still get their HTTP status
                    response = web.StreamResponse(
                        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
                    )
                    await response.prepare(request)
                await response.write(builder.take_events())
        except ApiError as exc:
            if response is None:
                raise
            log.warning("stream %s ended with an error: %s", builder.response_id, exc.message)
            builder.emit("error", code=exc.code, message=exc.message, param=exc.param)
            await response.write(builder.take_events())
            return response
    assert response is not None
    generation.record_usage()
    choice = generation.choices[0]
    builder.finish(choice.usage or UsageCount(), choice.finish_reason)
    await response.write(builder.take_events())
    await response.write_eof()
    return response


def add_routes(app: web.Application) -> None:
    app.router.add_post("/v1/responses", handle)
