"""`tool_choice: "required"` and a named function, guaranteed: the worker's structured-output engine
(llguidance) constrains generation to well-formed calls in the served format, with arguments valid
against each function's JSON Schema. The grammar is Lark (llguidance's dialect) with the calls' JSON as
`%json{...}` schemas, so the model writes its own format (`<tool_call>` blocks, a `<TOOLCALL>` list)
and the same parser (gateway/tool_parsers.py) reads it back; the JSON fallback format needs no grammar,
only a `json_schema`. The request ends when the grammar is complete.

The constraint is checked here with the engine, as `response_format` is (gateway/structured.py): a
function's parameters schema the engine cannot compile is a 400 naming that tool, before any worker is
asked."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from gateway.api_errors import bad_request
from gateway.structured import structured_output_pb
from gateway.tool_calls import ToolRequest, ToolSpec
from hybridserve.errors import InvalidArgumentError
from hybridserve.structured_output import StructuredSpec, checked_grammar

if TYPE_CHECKING:  # protobuf only where the message is built (tests/gateway/test_layering.py)
    from hybridserve.v1 import generation_pb2 as pb

# Compact JSON, as the parsers' examples are written: with flexible whitespace a model that is unsure
# could spend its tokens on blanks.
NEWLINE = "\n"
_COMPACT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}


def call_schema(tool: ToolSpec) -> dict[str, Any]:
    """The JSON Schema of one call of `tool`: {"name": <its name>, "arguments": <its parameters>}."""
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": tool.parameters},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _lark_json(schema: dict[str, Any]) -> str:
    return "%json " + json.dumps(schema | {"x-guidance": _COMPACT}, ensure_ascii=False)


def _lark_string(text: str) -> str:
    return json.dumps(text)  # a Lark string literal: JSON's escapes are Lark's


def tool_grammar(tools: ToolRequest, parser: str) -> str:
    """The Lark grammar of the calls `tools` forces, in `parser`'s format ("granite" or "nemotron_h")."""
    forced = tools.forced_tools
    many = tools.parallel and tools.choice == "required"
    lines = ["%llguidance {}", ""]
    if parser == "granite":
        repeat = f" ({_lark_string(NEWLINE)} call)*" if many else ""
        lines.append(f"start: call{repeat}")
        lines.append(f"call: {_lark_string('<tool_call>' + NEWLINE)} fn {_lark_string(NEWLINE + '</tool_call>')}")
    elif parser == "nemotron_h":
        repeat = f" ({_lark_string(', ')} fn)*" if many else ""
        lines.append(f"start: {_lark_string('<TOOLCALL>[')} fn{repeat} {_lark_string(']</TOOLCALL>')}")
    else:
        raise ValueError(f"no grammar for the tool-call format {parser!r}")
    lines.append("fn: " + " | ".join(f"fn_{i}" for i in range(len(forced))))
    lines += [f"fn_{i}: {_lark_json(call_schema(t))}" for i, t in enumerate(forced)]
    return "\n".join(lines) + "\n"


def tool_json_schema(tools: ToolRequest) -> dict[str, Any]:
    """The JSON fallback format's schema: one call, or with parallel calls a non-empty list of them."""
    options = [call_schema(t) for t in tools.forced_tools]
    one: dict[str, Any] = options[0] if len(options) == 1 else {"anyOf": options}
    if tools.parallel and tools.choice == "required":
        return {"type": "array", "items": one, "minItems": 1}
    return one


def tool_spec(tools: ToolRequest | None, parser: str) -> StructuredSpec | None:
    """The structured output that guarantees the forced calls; None when the model may answer freely."""
    if tools is None or not tools.is_forced:
        return None
    if parser == "json":
        return StructuredSpec("json_schema", json.dumps(tool_json_schema(tools), ensure_ascii=False))
    return StructuredSpec("grammar", tool_grammar(tools, parser))


def tool_constraint(tools: ToolRequest | None, parser: str) -> pb.StructuredOutput | None:
    """`tool_spec` checked by the engine, as the gRPC StructuredOutput the workers compile; a 400 naming
    the tool (`tools[i]`) whose parameters schema the engine cannot take."""
    spec = tool_spec(tools, parser)
    if spec is None or tools is None:
        return None
    try:
        checked_grammar(spec, "tools")
    except InvalidArgumentError as exc:
        raise _culprit(tools) or bad_request(str(exc), "tools", "invalid_value") from None
    return structured_output_pb(spec)


def _culprit(tools: ToolRequest) -> Exception | None:
    """The error of the first forced tool whose parameters alone do not compile (None: only together)."""
    for i, tool in enumerate(tools.tools):
        if tool in tools.forced_tools:
            field = f"tools[{i}]"
            try:
                checked_grammar(StructuredSpec("json_schema", tool.parameters_json), f"{field} parameters")
            except InvalidArgumentError as exc:
                return bad_request(str(exc), field, "invalid_value")
    return None
