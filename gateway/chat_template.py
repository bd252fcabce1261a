"""Chat messages -> prompt text with the model's Jinja chat template, rendered as transformers renders
it (`apply_chat_template`): a sandboxed environment with trim_blocks and lstrip_blocks, the
loopcontrols extension, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, and
the special tokens of tokenizer_config.json as variables (`bos_token`, `eos_token`, ...), `tools=` and
messages with their `tool_calls` / `tool_call_id` as transformers passes them.

Special tokens stay the template's: `render_prompt(..., escape=...)` renders with each occurrence of those
strings in message content replaced by a placeholder no text holds, and reports where they stand in the
final text (`ChatPrompt.literal_spans`), so the tokenizer encodes them as literal text while the
template's own markers stay special (gateway/tokens.py)."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.api_errors import bad_request
from gateway.chat_messages import Message
from hybridserve.errors import InvalidArgumentError
from hybridserve.tokenizer_files import chat_template_source, read_tokenizer_config, special_tokens


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered chat prompt."""

    text: str
    literal_spans: tuple[tuple[int, int], ...] = ()  # [start, end) characters of `text` that are content's own
    # text although they spell a special token: tokenized as literal text


def message_dict(m: Message, escape: Any = None) -> dict[str, Any]:
    """A message as templates read it (OpenAI's shape, arguments of past calls as objects); `escape`
    maps the content's text before it is rendered."""
    content = m.content if escape is None else escape(m.content)
    data: dict[str, Any] = {"role": m.role, "content": None if m.null_content else content}
    if m.tool_calls:
        data["tool_calls"] = [c.to_template() for c in m.tool_calls]
    if m.tool_call_id is not None:
        data["tool_call_id"] = m.tool_call_id
    if m.name is not None:
        data["name"] = m.name
    return data


class TemplateError(Exception):
    """The template cannot be loaded (a deployment problem, reported at start-up)."""


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@dataclass(frozen=True)
class ChatTemplate:
    template: jinja2.Template
    special_tokens: dict[str, str]  # bos_token, eos_token, ... as the template sees them
    source: str = ""  # the Jinja text (its markers choose the tool-call and reasoning formats)

    @staticmethod
    def compile(source: str, special_tokens: dict[str, str]) -> ChatTemplate:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            return ChatTemplate(env.from_string(source), dict(special_tokens), source)
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"the chat template does not compile: {exc}") from exc

    def render(
        self,
        messages: Sequence[Message],
        tools: list[dict[str, Any]] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> str:
        """The prompt for these messages, ending with the assistant's turn opened (unless
        `add_generation_prompt` is false: /tokenize may ask for the conversation alone)."""
        return self.render_prompt(messages, tools, add_generation_prompt=add_generation_prompt).text

    def render_prompt(
        self,
        messages: Sequence[Message],
        tools: list[dict[str, Any]] | None = None,
        escape: Sequence[str] = (),
        *,
        add_generation_prompt: bool = True,
    ) -> ChatPrompt:
        """The prompt, with the spans where message content spells one of the `escape` strings (the
        tokenizer's special tokens) marked literal."""
        wanted = [s for s in escape if s and any(s in m.content for m in messages)]
        if not wanted:
            data = [message_dict(m) for m in messages]
            return ChatPrompt(self._render(data, tools, add_generation_prompt))
        nonce = uuid.uuid4().hex
        pattern = re.compile("|".join(re.escape(s) for s in sorted(wanted, key=len, reverse=True)))
        index = {s: i for i, s in enumerate(wanted)}

        def placeholder(match: re.Match[str]) -> str:
            return f"\ue000{nonce}{index[match.group(0)]}\ue001"

        data = [message_dict(m, lambda text: pattern.sub(placeholder, text)) for m in messages]
        rendered = self._render(data, tools, add_generation_prompt)
        parts: list[str] = []
        spans: list[tuple[int, int]] = []
        length = 0
        for piece in re.split(f"\ue000{nonce}(\\d+)\ue001", rendered):
            if len(parts) % 2:  # a placeholder's index
                special = wanted[int(piece)]
                spans.append((length, length + len(special)))
                piece = special
            parts.append(piece)
            length += len(piece)
        text = "".join(parts)
        if nonce in text.lower():  # the template changed its content's text (`| upper`, slicing): no spans
            raise bad_request(
                f"message content holds the special token {wanted[0]!r}, and this model's chat template"
                " transforms content so it cannot be kept literal text; remove it from the content",
                "messages",
            )
        return ChatPrompt(text, tuple(spans))

    def _render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, add_generation_prompt: bool
    ) -> str:
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,
                documents=None,
                **self.special_tokens,
            )
        except jinja2.exceptions.TemplateError as exc:  # raise_exception() in the template: the messages' fault
            raise bad_request(f"the chat template refused these messages: {exc}", "messages") from exc


def load_chat_template(model_dir: Path | None, override: Path | None = None) -> ChatTemplate | None:
    """The template of `override` (a Jinja file), else model_dir's (chat_template.jinja, else
    tokenizer_config.json's `chat_template`: hybridserve.tokenizer_files.chat_template_source); None when
    there is none."""
    try:
        config = read_tokenizer_config(model_dir) if model_dir is not None else {}
    except InvalidArgumentError as exc:
        raise TemplateError(str(exc)) from exc
    specials = special_tokens(config)
    if override is not None:
        return ChatTemplate.compile(override.read_text(), specials)
    source = chat_template_source(model_dir, config) if model_dir is not None else None
    return None if source is None else ChatTemplate.compile(source, specials)
