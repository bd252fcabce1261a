"""Chat messages -> prompt text with the model's Jinja chat template, rendered as transformers renders
it (`apply_chat_template`): a sandboxed environment with trim_blocks and lstrip_blocks, the
loopcontrols extension, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII text, and
the special tokens of tokenizer_config.json as variables (`bos_token`, `eos_token`, ...)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from gateway.api_errors import bad_request
from gateway.openai_request import Message
from hybridserve.errors import InvalidArgumentError
from hybridserve.tokenizer_files import chat_template_source, read_tokenizer_config, special_tokens


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

    @staticmethod
    def compile(source: str, special_tokens: dict[str, str]) -> ChatTemplate:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            return ChatTemplate(env.from_string(source), dict(special_tokens))
        except jinja2.exceptions.TemplateError as exc:
            raise TemplateError(f"the chat template does not compile: {exc}") from exc

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The prompt for these messages, ending with the assistant's turn opened (unless
        `add_generation_prompt` is false: /tokenize may ask for the conversation alone)."""
        data = [{"role": m.role, "content": m.content} for m in messages]
        try:
            return self.template.render(
                messages=data,
                add_generation_prompt=add_generation_prompt,
                tools=None,
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
