"""POST /tokenize and /detokenize in vLLM's shape, so benchmark clients (`hybridserve bench`, vLLM's,
GuideLLM's) and eval harnesses can size prompts in the served model's tokens without a local tokenizer;
GET /version as vLLM's.

    /tokenize    {"prompt": str | [int], "add_special_tokens"?: bool (true)}
                 or {"messages": [...], "tools"?: [...], "add_generation_prompt"?: bool (true),
                     "add_special_tokens"?: bool (false)}
                 (either with "return_token_strs"?: bool)
                 -> {"count": N, "max_model_len": M, "tokens": [int], "token_strs": [str] | null}
    /detokenize  {"tokens": [int]} -> {"prompt": str}
    /version     -> {"version": "0.1.0"}

The ids are those a generation request with the same body would be served on: a prompt is encoded
with the checkpoint's special tokens (unless add_special_tokens is false), messages through the chat
template, which holds its own (vLLM's defaults for both), with the `tools` the template is given and
message content's special-token text kept literal as chat requests keep it (gateway/http_app.py
`Gateway.render_chat`). max_model_len is the ready workers' smallest,
as generation requests are limited by it. `model`, when sent, must name the served model."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from gateway import api_errors
from gateway.chat_messages import parse_messages
from gateway.openai_request import MAX_TOKEN_ID, check_text_size
from gateway.tokens import GatewayTokenizer
from gateway.tool_calls import parse_tool_request
from hybridserve import __version__

T = TypeVar("T")
_TOKENIZE_FIELDS = frozenset(
    {"model", "prompt", "messages", "tools", "add_special_tokens", "add_generation_prompt", "return_token_strs"}
)
_DETOKENIZE_FIELDS = frozenset({"model", "tokens"})


def _tokenizer(request: web.Request) -> GatewayTokenizer:
    tokenizer: GatewayTokenizer | None = request.app["gateway"].tokenizer
    if tokenizer is None:
        raise api_errors.bad_request(request.app["gateway"].missing_tokenizer_reason(), code="no_tokenizer")
    return tokenizer


def _flag(body: dict[str, Any], name: str, default: bool) -> bool:
    value = body.get(name, default)
    if not isinstance(value, bool):
        raise api_errors.bad_request(f"'{name}' must be true or false", name, "invalid_type")
    return value


def _token_ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise api_errors.bad_request(f"'{name}' must be a list of token ids", name, "invalid_type")
    bad = next((t for t in value if not 0 <= t < MAX_TOKEN_ID), None)
    if bad is not None:
        raise api_errors.bad_request(f"'{name}' holds the token id {bad}, not a valid id", name, "invalid_value")
    return value


def _check_model(request: web.Request, body: dict[str, Any]) -> None:
    model = body.get("model")
    served = request.app["gateway"].served_model()
    if model is not None and served and model != served:
        raise api_errors.not_found(f"the model '{model}' does not exist; this server serves '{served}'", "model")


def _max_model_len(request: web.Request) -> int:
    """The ready workers' smallest limit, the one generation requests are held to (0: none ready)."""
    return int(request.app["gateway"].dispatcher.max_model_len())


async def _body(request: web.Request) -> dict[str, Any]:
    """The JSON object of the body, decoded as generation bodies are (gateway.body: size and depth limits,
    a large body off the event loop)."""
    from gateway.http_app import read_body  # (http_app adds these routes)

    body = await request.app["gateway"].bodies.decode(await read_body(request))
    if not isinstance(body, dict):
        raise api_errors.bad_request("the request body must be a JSON object")
    return body


async def tokenize(request: web.Request) -> web.Response:
    body = await _body(request)
    unknown = sorted(set(body) - _TOKENIZE_FIELDS)
    if unknown:
        raise api_errors.bad_request(f"unknown field(s) {', '.join(unknown)}", unknown[0], "unknown_parameter")
    _check_model(request, body)
    if ("prompt" in body) == ("messages" in body):
        raise api_errors.bad_request("send exactly one of 'prompt' and 'messages'", "prompt")
    with_strs = _flag(body, "return_token_strs", False)
    tokenizer = _tokenizer(request)
    if "messages" in body:
        gateway = request.app["gateway"]
        if gateway.chat_template is None:
            raise api_errors.bad_request(
                gateway.missing_template_reason() + "; tokenize a 'prompt'", "messages", "no_chat_template"
            )
        add_generation = _flag(body, "add_generation_prompt", True)
        add_special = _flag(body, "add_special_tokens", False)
        messages = parse_messages(body)
        tools = parse_tool_request({"tools": body.get("tools")})
        _check_size(request, [m.content for m in messages], "messages")
        tokens = await _off_loop(
            request,
            lambda: tokenizer.encode_chat(gateway.render_chat(messages, tools, add_generation), add_special),
        )
    else:
        for name in ("add_generation_prompt", "tools"):
            if name in body:
                raise api_errors.bad_request(f"'{name}' goes with 'messages'", name)
        prompt = body["prompt"]
        add_special = _flag(body, "add_special_tokens", True)
        if isinstance(prompt, str):
            _check_size(request, [prompt], "prompt")
            tokens = await _off_loop(request, lambda: tokenizer.encode(prompt, add_special_tokens=add_special))
        elif isinstance(prompt, list):
            tokens = _token_ids(prompt, "prompt")
        else:
            raise api_errors.bad_request("'prompt' must be a string or a list of token ids", "prompt", "invalid_type")
    token_strs = [tokenizer.token_text(t) for t in tokens] if with_strs else None
    return web.json_response(
        {"count": len(tokens), "max_model_len": _max_model_len(request), "tokens": tokens, "token_strs": token_strs}
    )


async def detokenize(request: web.Request) -> web.Response:
    body = await _body(request)
    unknown = sorted(set(body) - _DETOKENIZE_FIELDS)
    if unknown:
        raise api_errors.bad_request(f"unknown field(s) {', '.join(unknown)}", unknown[0], "unknown_parameter")
    _check_model(request, body)
    if "tokens" not in body:
        raise api_errors.bad_request("'tokens' is required", "tokens", "missing_required")
    tokens = _token_ids(body["tokens"], "tokens")
    tokenizer = _tokenizer(request)
    infos = [w.info for w in request.app["gateway"].dispatcher.pool.ready() if w.info is not None]
    vocab_size = max([tokenizer.vocab_size, *(int(i.vocab_size) for i in infos)])  # the model's may be padded
    bad = next((t for t in tokens if t >= vocab_size), None)
    if bad is not None:
        raise api_errors.bad_request(
            f"'tokens' holds the token id {bad}, outside the vocabulary (ids below {vocab_size})",
            "tokens",
            "invalid_value",
        )
    return web.json_response({"prompt": await _off_loop(request, lambda: tokenizer.decode(tokens))})


async def version(request: web.Request) -> web.Response:
    """The serving stack's version (the package's), as vLLM's GET /version."""
    return web.json_response({"version": __version__})


def _check_size(request: web.Request, texts: list[str], name: str) -> None:
    """Text longer than the served model could take is refused before it is tokenized, as for generation."""
    limits = request.app["gateway"].text_limits()
    if limits is not None:
        check_text_size(texts, name, limits)


async def _off_loop(request: web.Request, work: Callable[[], T]) -> T:
    """Tokenizer work on the gateway's text threads (inline when it has none)."""
    executor = request.app["gateway"].text_work
    if executor is None:
        return work()
    return await asyncio.get_running_loop().run_in_executor(executor, work)


def add_routes(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
    app.router.add_get("/version", version)
