"""Request bodies into `ApiRequest`s without stalling the event loop, whatever they hold.

`parse_body` is pure (bytes in, ApiRequest out, `ApiError` for anything else): JSON no deeper than
MAX_JSON_DEPTH, the OpenAI fields (openai_request.py), then the size of the text against the
`TextLimits` of the served model. `BodyParser` runs it in the event loop for a small body and in a
child process for a large one: decoding JSON holds the GIL for the whole call (16 MiB of `[[],[],...]`
takes seconds, of token ids most of a second), so a thread would stall the loop all the same, and
/health, every stream and every other request with it."""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

from gateway import api_errors
from gateway.openai_request import ApiRequest, TextLimits, check_prompt_size, parse_chat, parse_completion

log = logging.getLogger("hybridserve.gateway.body")

# A body up to this size is parsed in the event loop: the slowest JSON of that size (nested empty
# lists) decodes in about 20 ms on one core. Larger ones go to a child process.
SMALL_BODY_BYTES = 64 << 10
MAX_JSON_DEPTH = 32  # nesting of arrays and objects; OpenAI's bodies need 5 (messages, parts)
PARSE_PROCESSES = 2  # child processes decoding large bodies; more bodies wait their turn


def json_depth(value: Any) -> int:
    """The nesting depth of decoded JSON (a scalar is 0, `[]` 1), walked without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            stack.extend((v, depth + 1) for v in item.values())
            deepest = max(deepest, depth + 1)
        elif isinstance(item, list):
            stack.extend((v, depth + 1) for v in item)
            deepest = max(deepest, depth + 1)
    return deepest


def decode_json(raw: bytes) -> Any:
    too_deep = api_errors.bad_request(
        f"the request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
    )
    try:
        body = json.loads(raw)
    except RecursionError:
        raise too_deep from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise api_errors.bad_request(f"the request body is not valid JSON: {exc}", code="invalid_json") from None
    if json_depth(body) > MAX_JSON_DEPTH:
        raise too_deep
    return body


def parse_body(raw: bytes, kind: str, limits: TextLimits | None) -> ApiRequest:
    """The request of a /v1/completions (`kind` "completion") or /v1/chat/completions ("chat") body,
    its text checked against `limits` (None: not known here; the worker checks)."""
    body = decode_json(raw)
    api = parse_chat(body) if kind == "chat" else parse_completion(body)
    if limits is not None:
        check_prompt_size(api, limits)
    return api


class BodyParser:
    """`parse_body` off the event loop for large bodies, in at most PARSE_PROCESSES child processes
    (spawned at the first large body, not forked: this process runs gRPC threads)."""

    def __init__(self) -> None:
        self._pool: ProcessPoolExecutor | None = None

    async def parse(self, raw: bytes, kind: str, limits: TextLimits | None) -> ApiRequest:
        if len(raw) <= SMALL_BODY_BYTES:
            return parse_body(raw, kind, limits)
        return await self._in_child(parse_body, raw, kind, limits)  # type: ignore[no-any-return]

    async def decode(self, raw: bytes) -> Any:
        """`decode_json` of any body (the routes that are not generation requests), by the same rule."""
        if len(raw) <= SMALL_BODY_BYTES:
            return decode_json(raw)
        return await self._in_child(decode_json, raw)

    async def _in_child(self, fn: Any, *args: Any) -> Any:
        if self._pool is None:
            context = multiprocessing.get_context("spawn")
            self._pool = ProcessPoolExecutor(PARSE_PROCESSES, mp_context=context)
        pool = self._pool
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)
        except BrokenProcessPool:  # a child died (killed, out of memory): the next body gets a fresh pool
            log.error("a body-parsing process died; starting new ones")
            if self._pool is pool:
                self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise api_errors.unavailable("the server could not parse this request body now; retry") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
