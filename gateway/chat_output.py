"""A chat choice's output text -> the assistant message: reasoning (gateway/reasoning.py), content and
tool calls (gateway/tool_parsers.py), chained: the reasoning splitter first, the tool-call parser on what
it leaves as content. The same incremental pass serves streams (OpenAI's `delta.reasoning_content`,
`delta.content`, `delta.tool_calls`) and whole bodies, so both say the same. Pure."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gateway.reasoning import ReasoningSplitter
from gateway.tool_calls import ToolCall
from gateway.tool_parsers import Piece, ToolCallParser


@dataclass
class OutputParser:
    """One choice's parsers; `feed` each new text, `finish` at the end (both return the new pieces).
    With tools, content's trailing whitespace is held until text follows it: the newlines before, between
    and after calls are no content of their own."""

    reasoning: ReasoningSplitter | None = None
    tools: ToolCallParser | None = None
    parallel: bool = True  # False: only the first call counts (parallel_tool_calls: false)
    pieces: list[Piece] = field(default_factory=list)  # everything so far
    calls: list[ToolCall] = field(default_factory=list)
    pending_space: str = ""

    def feed(self, text: str) -> list[Piece]:
        return self._take(self._split(text, finished=False))

    def finish(self) -> list[Piece]:
        return self._take(self._split("", finished=True), finished=True)

    def _split(self, text: str, finished: bool) -> list[Piece]:
        pieces = [Piece("content", text)] if text else []
        if self.reasoning is not None:
            pieces = self.reasoning.feed(text) if text else []
            if finished:
                pieces += self.reasoning.finish()
        if self.tools is None:
            return pieces
        out: list[Piece] = []
        for piece in pieces:
            out += self.tools.feed(piece.text) if piece.kind == "content" else [piece]
        if finished:
            out += self.tools.finish()
        return out

    def _take(self, pieces: list[Piece], finished: bool = False) -> list[Piece]:
        out: list[Piece] = []
        for piece in pieces:
            if piece.kind == "call":
                self.pending_space = ""
                if self.calls and not self.parallel:
                    continue
                assert piece.call is not None
                self.calls.append(piece.call)
            elif piece.kind == "content" and self.tools is not None:
                text = self.pending_space + piece.text
                kept = text.rstrip()
                self.pending_space = text[len(kept) :]
                if not kept:
                    continue
                piece = Piece("content", kept)
            out.append(piece)
        if finished and self.pending_space and not self.calls:
            out.append(Piece("content", self.pending_space))
        self.pending_space = "" if finished else self.pending_space
        self.pieces += out
        return out

    def text_of(self, kind: str) -> str | None:
        texts = [p.text for p in self.pieces if p.kind == kind]
        return "".join(texts) if texts else None


def chat_deltas(pieces: list[Piece], calls_before: int) -> list[dict[str, Any]]:
    """OpenAI stream deltas of these pieces; `calls_before` numbers the calls (`index`). A call is two
    deltas: its id, type and name (arguments ""), then its arguments."""
    deltas: list[dict[str, Any]] = []
    index = calls_before
    for piece in pieces:
        if piece.kind == "call":
            assert piece.call is not None
            head = {"index": index, "id": piece.call.id, "type": "function"}
            deltas.append({"tool_calls": [head | {"function": {"name": piece.call.name, "arguments": ""}}]})
            deltas.append({"tool_calls": [{"index": index, "function": {"arguments": piece.call.arguments}}]})
            index += 1
        elif piece.kind == "reasoning":
            deltas.append({"reasoning_content": piece.text})
        else:
            deltas.append({"content": piece.text})
    return deltas


def chat_message(parser: OutputParser) -> dict[str, Any]:
    """The assistant message of a finished choice."""
    content = parser.text_of("content")
    if content is None and not parser.calls and parser.text_of("reasoning") is None:
        content = ""  # nothing at all: an empty answer (null content says "see the calls, or the reasoning")
    message: dict[str, Any] = {"role": "assistant", "content": content or None if parser.calls else content}
    message["refusal"] = None
    if parser.reasoning is not None:
        message["reasoning_content"] = parser.text_of("reasoning")
    message["tool_calls"] = [c.to_json() for c in parser.calls] if parser.calls else None
    return message
