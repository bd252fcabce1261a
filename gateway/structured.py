"""Structured outputs on the OpenAI surface: the body's `response_format` (OpenAI's) and `structured_outputs`
(vLLM's extension) parsed into a `StructuredSpec`, checked by the grammar engine here (a spec it cannot
compile is a 400 naming the body's field, before any worker is asked), and the spec as the gRPC
`StructuredOutput` the workers compile against their vocabulary.

Accepted, on /v1/chat/completions and /v1/completions alike:

    response_format: {"type": "text"}                                     no constraint
                     {"type": "json_object"}                              any JSON object
                     {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": ...}}
    structured_outputs: {"json": {...} or "<schema text>"} | {"json_object": true} | {"regex": "..."}
                        | {"choice": ["a", "b"]} | {"grammar": "<Lark, or GBNF when it uses ::=>"}
                        (+ "disable_any_whitespace": bool)

JSON output is compact (no whitespace between tokens) unless `structured_outputs.disable_any_whitespace` is
false. `strict` is accepted either way: the output always follows the schema.

`tool_call_output` is for tool calling: the StructuredOutput of one or more calls, each a JSON value valid
against a schema, between fixed tags."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from gateway.api_errors import bad_request, unsupported
from hybridserve.errors import InvalidArgumentError
from hybridserve.structured_output import StructuredSpec, checked_grammar

if TYPE_CHECKING:  # the parsing stays pure (tests/gateway/test_layering.py): protobuf only where messages are built
    from hybridserve.v1 import generation_pb2 as pb

FIELDS = ("response_format", "structured_outputs")  # the body fields this module reads
_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_VLLM_FIELDS = frozenset({*_KINDS, "disable_any_whitespace"})
_JSON_SCHEMA_FIELDS = frozenset({"name", "schema", "strict", "description"})


def parse_structured(body: Mapping[str, Any]) -> StructuredSpec | None:
    """The body's constraint (None: free text); a 400 naming the field for anything the engine cannot take."""
    from_format = _response_format(body.get("response_format"))
    from_vllm = _structured_outputs(body.get("structured_outputs"))
    if from_format is not None and from_vllm is not None:
        raise bad_request(
            "'response_format' and 'structured_outputs' both constrain the output; send one of them",
            "structured_outputs",
        )
    return from_format or from_vllm


def _checked(spec: StructuredSpec, field: str) -> StructuredSpec:
    try:
        checked_grammar(spec, field)
    except InvalidArgumentError as exc:
        raise bad_request(str(exc), field, "invalid_value") from None
    return spec


def _object(value: Any, field: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise bad_request(f"'{field}' must be an object, got {type(value).__name__}", field, "invalid_type")
    return value


def _response_format(value: Any) -> StructuredSpec | None:
    if value is None:
        return None
    value = _object(value, "response_format")
    kind = value.get("type")
    extra = [k for k in value if k not in ("type", "json_schema")]
    if extra:
        raise bad_request(f"unrecognized argument 'response_format.{extra[0]}'", f"response_format.{extra[0]}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredSpec("json_object")
    if kind != "json_schema":
        raise bad_request(
            f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r:.40}",
            "response_format.type",
            "invalid_value",
        )
    spec = _object(value.get("json_schema"), "response_format.json_schema")
    unknown = next((k for k in spec if k not in _JSON_SCHEMA_FIELDS), None)
    if unknown is not None:
        raise bad_request(
            f"unrecognized argument 'response_format.json_schema.{unknown}'", f"response_format.json_schema.{unknown}"
        )
    if "name" in spec and not isinstance(spec["name"], str):
        raise bad_request("'response_format.json_schema.name' must be a string", "response_format.json_schema.name")
    if "strict" in spec and spec["strict"] is not None and not isinstance(spec["strict"], bool):
        raise bad_request(
            "'response_format.json_schema.strict' must be a boolean", "response_format.json_schema.strict"
        )
    schema = spec.get("schema")
    if schema is None:  # OpenAI's default: any JSON object
        return StructuredSpec("json_object")
    field = "response_format.json_schema.schema"
    if not isinstance(schema, dict | bool):
        raise bad_request(f"'{field}' must be a JSON Schema (an object), got {type(schema).__name__}", field)
    return _checked(StructuredSpec("json_schema", json.dumps(schema)), field)


def _structured_outputs(value: Any) -> StructuredSpec | None:
    if value is None:
        return None
    value = _object(value, "structured_outputs")
    for key in value:
        if key not in _VLLM_FIELDS:
            raise unsupported(f"structured_outputs.{key}")
    kinds = [k for k in _KINDS if value.get(k) is not None and value.get(k) is not False]
    if len(kinds) != 1:
        raise bad_request(
            f"'structured_outputs' must set exactly one of {', '.join(_KINDS)}; it sets {len(kinds)}",
            "structured_outputs",
        )
    kind = kinds[0]
    field = f"structured_outputs.{kind}"
    flexible = value.get("disable_any_whitespace")
    if flexible is not None and not isinstance(flexible, bool):
        raise bad_request("'structured_outputs.disable_any_whitespace' must be a boolean",
                          "structured_outputs.disable_any_whitespace", "invalid_type")  # fmt: skip
    any_whitespace = flexible is False  # set false: whitespace allowed; unset or true: compact JSON
    raw = value[kind]
    if kind == "json":
        if isinstance(raw, str):
            try:
                raw = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise bad_request(f"'{field}' is not valid JSON: {exc}", field, "invalid_value") from None
        if not isinstance(raw, dict | bool):
            raise bad_request(f"'{field}' must be a JSON Schema (an object), got {type(raw).__name__}", field)
        return _checked(StructuredSpec("json_schema", json.dumps(raw), any_whitespace), field)
    if kind == "json_object":
        if raw is not True:
            raise bad_request(f"'{field}' must be true", field, "invalid_value")
        return StructuredSpec("json_object", "", any_whitespace)
    if kind == "choice":
        if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
            raise bad_request(f"'{field}' must be a list of strings", field, "invalid_type")
        return _checked(StructuredSpec.choices(raw), field)
    if not isinstance(raw, str):
        raise bad_request(f"'{field}' must be a string", field, "invalid_type")
    return _checked(StructuredSpec("regex" if kind == "regex" else "grammar", raw), field)


def structured_output_pb(spec: StructuredSpec) -> pb.StructuredOutput:
    """The gRPC message of a spec (the worker compiles it: hybridserve.structured_output)."""
    from hybridserve.v1 import generation_pb2 as pb

    message = pb.StructuredOutput(any_whitespace=spec.any_whitespace)
    if spec.kind == "json_object":
        message.json_object = True
    elif spec.kind == "choice":
        message.choice.values.extend(json.loads(spec.value))
    else:
        setattr(message, spec.kind, spec.value)
    return message


def tool_call_output(
    schema: Mapping[str, Any] | bool,
    open_tag: str = "<tool_call>",
    close_tag: str = "</tool_call>",
    *,
    many: bool = False,
    separator: str = "\n",
) -> pb.StructuredOutput:
    """The StructuredOutput (a Lark grammar) of tool calls: `open_tag`, one JSON value valid against `schema`
    (compact, as llguidance's `%json` writes it), `close_tag`; with `many`, one or more such calls with
    `separator` between them. The output ends (FINISH_REASON_STOP) right after the last `close_tag`.

    `schema` is a JSON Schema (a dict, or True for any JSON value): for a named function, the call's
    envelope, e.g. {"type": "object", "properties": {"name": {"const": "get_weather"}, "arguments":
    <the function's parameters schema>}, "required": ["name", "arguments"], "additionalProperties": false};
    for `tool_choice: "required"`, an `anyOf` of such envelopes. Tags and separator are literal text; a tag
    the tokenizer holds as a special token must be given as that token, in llguidance's syntax `<[id]>`
    (e.g. "<[100264]>"), since special tokens never match literal text. Raises gateway.api_errors.ApiError
    (400, field `tools`) when the schema cannot be compiled."""
    body = json.dumps(schema)
    call = f"{_lark_literal(open_tag)} call_json {_lark_literal(close_tag)}"
    start = f"start: call ({json.dumps(separator)} call)*" if many else "start: call"
    grammar = f"{start}\ncall: {call}\ncall_json: %json {body}\n"
    return structured_output_pb(_checked(StructuredSpec("grammar", grammar), "tools"))


def _lark_literal(tag: str) -> str:
    """A tag in Lark: quoted text, or a special token's `<[id]>` as it is."""
    if tag.startswith("<[") and tag.endswith("]>") and tag[2:-2].isdigit():
        return tag
    return json.dumps(tag)
