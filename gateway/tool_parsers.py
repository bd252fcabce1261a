"""The model's output text -> content and tool calls, one parser per format the supported families'
templates use, each incremental (text arrives in pieces; a piece that may begin a marker is held back
until the next one tells):

- `granite`: Granite-4.0's (and Hermes', Qwen's) `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
  one call per block (vLLM calls this format `hermes`, accepted as a name too);
- `nemotron_h`: Nemotron-H's `<TOOLCALL>[{"name": ..., "arguments": {...}}, ...]</TOOLCALL>`, a JSON list;
- `json`: a Hermes-style JSON fallback: the whole output one `{"name", "arguments"}` object or a list of them.

`pick_parser` chooses from the template's source (the markers it writes) unless a name is given. A block
that does not hold well-formed calls stays content, as the model wrote it. Pure: no I/O."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from gateway.tool_calls import ToolCall, new_call_id

PARSER_NAMES = ("granite", "nemotron_h", "json")
ALIASES = {"hermes": "granite"}


@dataclass(frozen=True, slots=True)
class Piece:
    """A part of the output: content or reasoning text, or one complete tool call."""

    kind: str  # "content", "reasoning" or "call"
    text: str = ""
    call: ToolCall | None = None


def partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (text to hold back: it may be the
    start of the tag, which the next piece completes)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def calls_of(value: Any) -> list[ToolCall] | None:
    """Tool calls from decoded JSON: one {"name", "arguments"|"parameters"} object or a list of them;
    None when it is not that."""
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or not item["name"]:
            return None
        arguments = item.get("arguments", item.get("parameters", {}))
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except ValueError:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append(ToolCall(new_call_id(), item["name"], json.dumps(arguments, ensure_ascii=False)))
    return calls or None


def _decode(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None


class ToolCallParser:
    """The interface: `feed` each new piece of text, then `finish` once; each returns the pieces that
    are now certain."""

    def feed(self, text: str) -> list[Piece]:
        raise NotImplementedError

    def finish(self) -> list[Piece]:
        raise NotImplementedError


class TaggedParser(ToolCallParser):
    """Calls as JSON between a start and an end tag; text outside the blocks is content."""

    def __init__(self, start: str, end: str) -> None:
        self.start, self.end = start, end
        self.buffer = ""
        self.inside = False

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        pieces: list[Piece] = []
        while True:
            if not self.inside:
                at = self.buffer.find(self.start)
                if at < 0:
                    keep = partial_suffix(self.buffer, self.start)
                    ready, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
                    if ready:
                        pieces.append(Piece("content", ready))
                    return pieces
                if at:
                    pieces.append(Piece("content", self.buffer[:at]))
                self.buffer, self.inside = self.buffer[at + len(self.start) :], True
            at = self.buffer.find(self.end)
            if at < 0:
                return pieces
            pieces += self._block(self.buffer[:at], closed=True)
            self.buffer, self.inside = self.buffer[at + len(self.end) :], False

    def finish(self) -> list[Piece]:
        if self.inside:  # the output ended inside a block (EOS right after the JSON, or out of tokens)
            pieces = self._block(self.buffer, closed=False)
        else:
            pieces = [Piece("content", self.buffer)] if self.buffer else []
        self.buffer, self.inside = "", False
        return pieces

    def _block(self, body: str, closed: bool) -> list[Piece]:
        calls = calls_of(_decode(body.strip()))
        if calls is None:
            return [Piece("content", self.start + body + (self.end if closed else ""))]
        return [Piece("call", call=c) for c in calls]


class JsonParser(ToolCallParser):
    """The whole output as a call (or a list of calls) in JSON; anything else is content. Output that
    starts with `{` or `[` is held until the end, since only then is it known to be one."""

    def __init__(self) -> None:
        self.buffer = ""
        self.holding: bool | None = None  # None: only whitespace so far

    def feed(self, text: str) -> list[Piece]:
        self.buffer += text
        if self.holding is None and self.buffer.strip():
            self.holding = self.buffer.lstrip()[0] in "{["
        if self.holding is False:
            ready, self.buffer = self.buffer, ""
            return [Piece("content", ready)] if ready else []
        return []

    def finish(self) -> list[Piece]:
        text, self.buffer = self.buffer, ""
        calls = calls_of(_decode(text.strip())) if self.holding else None
        if calls is not None:
            return [Piece("call", call=c) for c in calls]
        return [Piece("content", text)] if text else []


def make_parser(name: str) -> ToolCallParser:
    name = ALIASES.get(name, name)
    if name == "granite":
        return TaggedParser("<tool_call>", "</tool_call>")
    if name == "nemotron_h":
        return TaggedParser("<TOOLCALL>", "</TOOLCALL>")
    if name == "json":
        return JsonParser()
    raise ValueError(f"unknown tool-call parser {name!r}: use one of {', '.join(PARSER_NAMES)}")


def pick_parser(name: str, template_source: str | None) -> str:
    """The parser's name: `name` unless it is "auto", else the format the template writes (its markers),
    else the JSON fallback."""
    name = ALIASES.get(name, name)
    if name != "auto":
        if name not in PARSER_NAMES:
            raise ValueError(f"unknown tool-call parser {name!r}: use auto or one of {', '.join(PARSER_NAMES)}")
        return name
    source = template_source or ""
    if "<TOOLCALL>" in source:
        return "nemotron_h"
    if "<tool_call>" in source:
        return "granite"
    return "json"
