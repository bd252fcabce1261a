"""POST /tokenize and /detokenize in vLLM's shape, so benchmark clients (`hybridserve bench`, vLLM's,
GuideLLM's) can size prompts in the served model's tokens without a local tokenizer.

    /tokenize    {"prompt": str | [int], "add_special_tokens"?: bool}  or  {"messages": [...]}
                 -> {"tokens": [int], "count": N, "max_model_len": M, "token_strs": null}
    /detokenize  {"tokens": [int]} -> {"prompt": str}

The ids are those a generation request with the same body would be served on: a prompt is encoded
with the checkpoint's special tokens (unless add_special_tokens is false), messages through the chat
template, which holds its own. `model`, when sent, must name the served model."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from gateway import api_errors
from gateway.openai_request import _messages, check_text_size
from gateway.tokens import GatewayTokenizer

T = TypeVar("T")
_TOKENIZE_FIELDS = frozenset({"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt"})


def _tokenizer(request: web.Request) -> GatewayTokenizer:
    tokenizer: GatewayTokenizer | None = request.app["gateway"].tokenizer
    if tokenizer is None:
        raise api_errors.bad_request(
            "this gateway has no tokenizer: start it with --model DIR|ORG/NAME (the workers' model)",
            code="no_tokenizer",
        )
    return tokenizer


def _check_model(request: web.Request, body: dict[str, Any]) -> None:
    model = body.get("model")
    served = request.app["gateway"].served_model()
    if model is not None and served and model != served:
        raise api_errors.not_found(f"the model '{model}' does not exist; this server serves '{served}'", "model")


def _max_model_len(request: web.Request) -> int:
    infos = [w.info for w in request.app["gateway"].dispatcher.pool.workers.values() if w.info is not None]
    return max((int(i.max_model_len) for i in infos), default=0)


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
        raise api_errors.bad_request(f"unknown field(s) {', '.join(unknown)}", unknown[0])
    _check_model(request, body)
    tokenizer = _tokenizer(request)
    if ("prompt" in body) == ("messages" in body):
        raise api_errors.bad_request("send exactly one of 'prompt' and 'messages'", "prompt")
    if "messages" in body:
        template = request.app["gateway"].chat_template
        if template is None:
            raise api_errors.bad_request("this model has no chat template; tokenize a 'prompt'", "messages")
        messages = _messages(body)
        _check_size(request, [m.content for m in messages], "messages")
        tokens = await _off_loop(request, lambda: tokenizer.encode(template.render(messages), add_special_tokens=False))
    else:
        prompt = body["prompt"]
        add_special = body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise api_errors.bad_request("'add_special_tokens' must be true or false", "add_special_tokens")
        if isinstance(prompt, str):
            _check_size(request, [prompt], "prompt")
            tokens = await _off_loop(request, lambda: tokenizer.encode(prompt, add_special_tokens=add_special))
        elif isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            tokens = list(prompt)
        else:
            raise api_errors.bad_request("'prompt' must be a string or a list of token ids", "prompt")
    return web.json_response(
        {"tokens": tokens, "count": len(tokens), "max_model_len": _max_model_len(request), "token_strs": None}
    )


async def detokenize(request: web.Request) -> web.Response:
    body = await _body(request)
    _check_model(request, body)
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
        raise api_errors.bad_request("'tokens' must be a list of token ids", "tokens")
    tokenizer = _tokenizer(request)
    return web.json_response({"prompt": await _off_loop(request, lambda: tokenizer.decode(tokens))})


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
