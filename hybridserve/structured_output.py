"""Structured-output constraints as the grammar engine (llguidance) takes them: one `StructuredSpec` (the
public `StructuredOutput` message's content, without protobuf) turned into an llguidance grammar, and
checked without a tokenizer.

Both sides use it: the worker compiles the grammar against its vocabulary at admission
(gpu_worker.engine.grammar), and the gateway checks an OpenAI body's spec before it sends anything, so that
a bad schema is a 400 naming the body's own field (gateway.structured). Every failure is an
InvalidArgumentError whose message names the problem and the field it came from (`field`: the name of the
spec's value in the caller's message; default `structured_output.<kind>`, the gRPC field).

Bounds: a spec's text is at most MAX_SPEC_CHARS, a choice list at most MAX_CHOICES strings, and the
engine's own fuel limits (`parser_limits`) cap the lexer and parser work of building and of every step,
so that a pathological schema fails fast instead of holding a request or a step."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import llguidance

from hybridserve.errors import InvalidArgumentError

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")
MAX_SPEC_CHARS = 256 * 1024  # a schema, regex or grammar's text
MAX_CHOICES = 1024
# Lexer/parser fuel (llguidance.LLParserLimits): its defaults, with the grammar's size halved; every
# step's work stays bounded by step_lexer_fuel and step_max_items.
MAX_GRAMMAR_SYMBOLS = 250_000
ANY_JSON_OBJECT = '{"type": "object"}'


@dataclass(frozen=True, slots=True)
class StructuredSpec:
    """What the output must match. `value`: the JSON schema's text, the regex, the grammar's text, or the
    choices as a JSON list (json_object: empty). `any_whitespace`: JSON may hold whitespace between
    tokens (else compact)."""

    kind: Kind
    value: str = ""
    any_whitespace: bool = False

    @classmethod
    def choices(cls, values: list[str] | tuple[str, ...]) -> StructuredSpec:
        return cls("choice", json.dumps(list(values)))


def parser_limits() -> llguidance.LLParserLimits:
    """The engine's limits for building and running a matcher (see the module docstring)."""
    return llguidance.LLParserLimits(max_grammar_size=MAX_GRAMMAR_SYMBOLS, verbose_errors=False)


def to_grammar(spec: StructuredSpec, field: str | None = None) -> str:
    """The llguidance grammar of `spec` (not yet checked: `check_grammar`). Raises InvalidArgumentError for
    a spec that is not even well formed (a schema that is not JSON, an empty choice list, ...)."""
    if spec.kind not in KINDS:
        raise InvalidArgumentError(
            f"{field or 'structured_output'}: unknown kind {spec.kind!r}; use one of {', '.join(KINDS)}"
        )
    name = field or f"structured_output.{spec.kind}"
    if len(spec.value) > MAX_SPEC_CHARS:
        raise InvalidArgumentError(f"{name} is {len(spec.value)} characters; at most {MAX_SPEC_CHARS} are accepted")
    options: JsonCompileOptions = {"whitespace_flexible": spec.any_whitespace}
    if spec.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema(ANY_JSON_OBJECT, defaults=options)
    if spec.kind == "json_schema":
        try:
            schema = json.loads(spec.value)
        except json.JSONDecodeError as exc:
            raise InvalidArgumentError(f"{name} is not valid JSON: {exc}") from None
        if not isinstance(schema, dict | bool):
            raise InvalidArgumentError(f"{name} must be a JSON object (a JSON Schema), got {type(schema).__name__}")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(spec.value, defaults=options)
        except ValueError as exc:
            raise InvalidArgumentError(f"{name}: {exc}") from None
    if spec.kind == "regex":
        if not spec.value:
            raise InvalidArgumentError(f"{name} is empty")
        return llguidance.LLMatcher.grammar_from_regex(spec.value)
    if spec.kind == "choice":
        values = json.loads(spec.value) if spec.value else []
        if not values:
            raise InvalidArgumentError(f"{name} is empty; give at least one string")
        if len(values) > MAX_CHOICES:
            raise InvalidArgumentError(f"{name} holds {len(values)} strings; at most {MAX_CHOICES} are accepted")
        if not all(isinstance(v, str) and v for v in values):
            raise InvalidArgumentError(f"{name} must hold non-empty strings only")
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(v) for v in values))
    if not spec.value.strip():
        raise InvalidArgumentError(f"{name} is empty")
    try:  # GBNF (llama.cpp's, `::=`) is converted to Lark; Lark is taken as it is
        return llguidance.grammar_from("grammar", spec.value)
    except ValueError as exc:
        raise InvalidArgumentError(f"{name}: {exc}") from None


def check_grammar(grammar: str, spec: StructuredSpec, field: str | None = None) -> None:
    """Raises InvalidArgumentError naming the problem when the engine cannot compile `grammar` (checked
    without a vocabulary: the worker's compile against its tokenizer may still refuse a grammar no token
    sequence can complete)."""
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar, None, limits=parser_limits())
    if is_error:
        name = field or f"structured_output.{spec.kind}"
        raise InvalidArgumentError(f"{name} cannot be compiled: {messages[0].strip()}")


def checked_grammar(spec: StructuredSpec, field: str | None = None) -> str:
    """`to_grammar` then `check_grammar`: the grammar of a spec the engine accepts."""
    grammar = to_grammar(spec, field)
    check_grammar(grammar, spec, field)
    return grammar
