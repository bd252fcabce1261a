"""Worker messages -> OpenAI response bodies and stream chunks. Pure: no I/O, no framework.

A worker streams `GenerateResponse` messages (new token ids, their log-probabilities, new text, and on
the last one finish_reason and usage). One `ChoiceState` per choice accumulates them into the
non-streaming body or turns each into one stream chunk."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from gateway.chat_output import OutputParser, chat_deltas, chat_message
from hybridserve.v1 import generation_pb2 as pb

if TYPE_CHECKING:
    from gateway.echo import Echo

TokenText = Callable[[int], str]  # token id -> its text (as decoded alone)


def openai_finish_reason(reason: int) -> str | None:
    """The worker's finish reason (a `pb.FinishReason`) in OpenAI's words: the token budget ran out
    -> "length"; a stop string or the end-of-sequence token -> "stop". Anything else (an aborted or
    failed request) is not a normal end: None, and the caller reports an error instead of a choice."""
    if reason == pb.FINISH_REASON_LENGTH:
        return "length"
    if reason in (pb.FINISH_REASON_STOP, pb.FINISH_REASON_EOS):
        return "stop"
    return None


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex


@dataclass(frozen=True, slots=True)
class UsageCount:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from a worker's prefix cache
    completion_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": self.cached_tokens},
        }


def total_usage(usages: Sequence[UsageCount]) -> UsageCount:
    """n choices of one prompt: the prompt counted once (as OpenAI does), completions summed."""
    if not usages:
        return UsageCount()
    return UsageCount(usages[0].prompt_tokens, usages[0].cached_tokens, sum(u.completion_tokens for u in usages))


def request_usage(choices: Sequence[ChoiceState], n: int) -> UsageCount:
    """A request's usage: each prompt's n choices as `total_usage` counts them (prompt i's are choices
    i*n .. i*n+n-1), the prompts of a batch summed, as vLLM sums them."""
    groups: dict[int, list[UsageCount]] = {}
    for choice in choices:
        if choice.usage is not None:
            groups.setdefault(choice.index // max(n, 1), []).append(choice.usage)
    parts = [total_usage(usages) for usages in groups.values()]
    prompt_tokens = sum(u.prompt_tokens for u in parts)
    return UsageCount(prompt_tokens, sum(u.cached_tokens for u in parts), sum(u.completion_tokens for u in parts))


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def chat_logprobs(msg: pb.GenerateResponse, token_text: TokenText) -> list[dict[str, Any]]:
    """OpenAI chat `logprobs.content` entries of this message's tokens."""
    entries = []
    for i, (token_id, logprob) in enumerate(zip(msg.token_ids, msg.logprobs, strict=False)):
        top = msg.top_logprobs[i] if i < len(msg.top_logprobs) else None
        alternatives = (
            []
            if top is None
            else [
                {"token": token_text(t), "logprob": lp, "bytes": _bytes(token_text(t))}
                for t, lp in zip(top.token_ids, top.logprobs, strict=False)
            ]
        )
        text = token_text(token_id)
        entries.append({"token": text, "logprob": logprob, "bytes": _bytes(text), "top_logprobs": alternatives})
    return entries


@dataclass(slots=True)
class CompletionLogprobs:
    """OpenAI completions `logprobs` (parallel lists); text_offset counts characters of token texts."""

    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float | None] = field(default_factory=list)  # None: an echoed prompt's first token
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)
    offset: int = 0  # characters of the completion so far

    def add(self, msg: pb.GenerateResponse, token_text: TokenText, with_top: bool) -> CompletionLogprobs:
        """Appends this message's tokens; returns a CompletionLogprobs of just them (for a chunk)."""
        part = CompletionLogprobs(offset=self.offset)
        for i, (token_id, logprob) in enumerate(zip(msg.token_ids, msg.logprobs, strict=False)):
            text = token_text(token_id)
            part.tokens.append(text)
            part.token_logprobs.append(logprob)
            part.text_offset.append(part.offset)
            part.offset += len(text)
            if with_top:
                top = msg.top_logprobs[i] if i < len(msg.top_logprobs) else None
                pairs = () if top is None else zip(top.token_ids, top.logprobs, strict=False)
                part.top_logprobs.append({token_text(t): lp for t, lp in pairs})
        self.tokens += part.tokens
        self.token_logprobs += part.token_logprobs
        self.top_logprobs += part.top_logprobs
        self.text_offset += part.text_offset
        self.offset = part.offset
        return part

    def joined(self, later: CompletionLogprobs) -> CompletionLogprobs:
        """These entries, then `later`'s (a new object; the offset is `later`'s, or this one's when it is empty)."""
        return CompletionLogprobs(
            self.tokens + later.tokens, self.token_logprobs + later.token_logprobs,
            self.top_logprobs + later.top_logprobs, self.text_offset + later.text_offset,
            later.offset if later.tokens else self.offset,
        )  # fmt: skip

    def to_json(self, with_top: bool) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs if with_top else None,
            "text_offset": self.text_offset,
        }


@dataclass(slots=True)
class ChoiceState:
    """One choice's text, log-probabilities, finish reason and usage, as messages arrive."""

    index: int
    kind: str  # "completion" or "chat"
    want_logprobs: bool
    with_top: bool
    token_text: TokenText
    text: list[str] = field(default_factory=list)
    completion_logprobs: CompletionLogprobs = field(default_factory=CompletionLogprobs)
    chat_logprobs: list[dict[str, Any]] = field(default_factory=list)
    finish_reason: str | None = None
    usage: UsageCount | None = None
    sent_role: bool = False
    echo: Echo | None = None  # completions with `echo` (gateway/echo.py)
    num_tokens: int = 0  # tokens generated so far
    output: OutputParser | None = None  # chat: reasoning and tool calls parsed out of the text (chat_output.py)
    more_deltas: list[dict[str, Any]] = field(default_factory=list)  # with `output`: the last message's others

    def entries(self, msg: pb.GenerateResponse) -> list[dict[str, Any]]:
        """Takes one worker message; returns this choice's stream chunk entries for it (one, or with
        `output` one per delta: a tool call's name comes before its arguments)."""
        entry = self.apply(msg)
        if not self.more_deltas:
            return [entry]
        last = {"index": self.index, "logprobs": None, "finish_reason": entry["finish_reason"]}
        entry["finish_reason"] = None
        rest = [{"index": self.index, "delta": d, "logprobs": None, "finish_reason": None} for d in self.more_deltas]
        rest[-1] = last | {"delta": self.more_deltas[-1]}
        return [entry, *rest]

    def _output_deltas(self, msg: pb.GenerateResponse) -> list[dict[str, Any]]:
        assert self.output is not None
        calls_before = len(self.output.calls)
        pieces = self.output.feed(msg.text) + (self.output.finish() if msg.finish_reason else [])
        if self.finish_reason == "stop" and self.output.calls:
            self.finish_reason = "tool_calls"
        return chat_deltas(pieces, calls_before)

    def apply(self, msg: pb.GenerateResponse) -> dict[str, Any]:
        """Takes one worker message; returns this choice's stream chunk entry for it (with `output`, the
        first of `entries`)."""
        prefix, echoed = "", None
        if self.echo is not None:
            prefix, echoed = self.echo.first(msg, self.token_text, self.with_top, self.want_logprobs)
            if echoed is not None:
                self.completion_logprobs = echoed.joined(CompletionLogprobs())
        self.text.append(prefix + msg.text)
        self.num_tokens += len(msg.token_ids)
        entry: dict[str, Any] = {"index": self.index}
        logprobs: Any = None
        if self.want_logprobs and self.kind == "chat":
            content = chat_logprobs(msg, self.token_text)
            self.chat_logprobs += content
            logprobs = {"content": content, "refusal": None}
        elif self.want_logprobs:
            part = self.completion_logprobs.add(msg, self.token_text, self.with_top)
            logprobs = (part if echoed is None else echoed.joined(part)).to_json(self.with_top)
        if msg.finish_reason:
            self.finish_reason = openai_finish_reason(msg.finish_reason)
            u = msg.usage
            self.usage = UsageCount(u.prompt_tokens, u.cached_tokens, u.completion_tokens)
        if self.kind == "chat" and self.output is not None:
            deltas = self._output_deltas(msg) or [{}]
            if not self.sent_role:
                deltas[0] = {"role": "assistant", **(deltas[0] or {"content": ""})}
                self.sent_role = True
            entry["delta"], self.more_deltas = deltas[0], deltas[1:]
        elif self.kind == "chat":
            delta: dict[str, Any] = {"content": msg.text} if msg.text or not msg.finish_reason else {}
            if not self.sent_role:
                delta = {"role": "assistant", "content": msg.text}
                self.sent_role = True
            entry["delta"] = delta
        else:
            entry["text"] = prefix + msg.text
        entry["logprobs"] = logprobs
        entry["finish_reason"] = self.finish_reason
        return entry

    def final_json(self) -> dict[str, Any]:
        """This choice in the non-streaming body."""
        text = "".join(self.text)
        logprobs: Any = None
        if self.want_logprobs and self.kind == "chat":
            logprobs = {"content": self.chat_logprobs, "refusal": None}
        elif self.want_logprobs:
            logprobs = self.completion_logprobs.to_json(self.with_top)
        if self.kind == "chat":
            message = {"role": "assistant", "content": text, "refusal": None}
            if self.output is not None:
                message = chat_message(self.output)
            return {"index": self.index, "message": message, "logprobs": logprobs, "finish_reason": self.finish_reason}
        return {"index": self.index, "text": text, "logprobs": logprobs, "finish_reason": self.finish_reason}


def envelope(
    kind: str, response_id: str, model: str, created: int | None = None, chunk: bool = False
) -> dict[str, Any]:
    """The fields every body and chunk starts with."""
    obj = ("chat.completion.chunk" if chunk else "chat.completion") if kind == "chat" else "text_completion"
    return {
        "id": response_id,
        "object": obj,
        "created": created or int(time.time()),
        "model": model,
        "system_fingerprint": None,
    }


@dataclass(frozen=True, slots=True)
class ChunkFrame:
    """One stream's chunk bytes around the choice entry: the envelope is the same in every chunk of
    a stream, so it is serialised once and each chunk serialises only its entry. The bytes equal
    `data: ` + the compact JSON of {envelope..., "choices": [entry], ("usage": null)} + a blank line."""

    head: bytes  # b'data: {"id":...,"system_fingerprint":null,"choices":['
    tail: bytes  # b']}\n\n', or b'],"usage":null}\n\n' when the stream ends with a usage chunk

    @staticmethod
    def of(kind: str, response_id: str, model: str, created: int, include_usage: bool) -> ChunkFrame:
        text = json.dumps(envelope(kind, response_id, model, created, chunk=True), separators=(",", ":"))
        tail = '],"usage":null}' if include_usage else "]}"
        return ChunkFrame(b"data: " + text[:-1].encode() + b',"choices":[', tail.encode() + b"\n\n")

    def sse(self, entry: dict[str, Any]) -> bytes:
        return self.head + json.dumps(entry, separators=(",", ":")).encode() + self.tail

    def sse_with_usage(self, entry: dict[str, Any], prompt_tokens: int, completion_tokens: int) -> bytes:
        """The chunk with its choice's usage so far (stream_options.continuous_usage_stats)."""
        usage = {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        }
        body = json.dumps(entry, separators=(",", ":")) + '],"usage":' + json.dumps(usage, separators=(",", ":"))
        return self.head + body.encode() + b"}\n\n"


def final_body(kind: str, response_id: str, model: str, choices: Sequence[ChoiceState], n: int = 1) -> dict[str, Any]:
    """The non-streaming body; `n` choices per prompt (request_usage)."""
    body = envelope(kind, response_id, model)
    body["choices"] = [c.final_json() for c in choices]
    body["usage"] = request_usage(choices, n).to_json()
    return body
