"""Tool calling on the request side: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, the
`tool_calls` of assistant messages and the `tool_call_id` of tool messages, validated into frozen values
(`ToolRequest`, `ToolCall`), and turned into what the chat template is given (`tools=`, message dicts
as transformers' `apply_chat_template` takes them). Pure: JSON in, dataclasses out, `ApiError` (400)
naming the field for anything else."""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.api_errors import bad_request, wrong_type

TOOL_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")  # OpenAI's rule for function names
CHOICE_MODES = ("none", "auto", "required")


@dataclass(frozen=True, slots=True)
class ToolSpec:
    """One function the model may call."""

    name: str
    description: str | None
    parameters_json: str  # its JSON Schema as JSON text ({"type": "object", "properties": {}} when unset)
    strict: bool | None

    @property
    def parameters(self) -> dict[str, Any]:
        value: dict[str, Any] = json.loads(self.parameters_json)
        return value

    def to_template(self) -> dict[str, Any]:
        """As chat templates read a tool (OpenAI's shape; transformers passes such dicts through)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True, slots=True)
class ToolRequest:
    """The tools of a request and how the model may use them."""

    tools: tuple[ToolSpec, ...]
    choice: str  # "none", "auto", "required" or "function" (a named one)
    function_name: str | None  # with choice "function"
    parallel: bool  # parallel_tool_calls: more than one call per turn

    @property
    def is_forced(self) -> bool:
        """The model must call a tool (generation is constrained to well-formed calls)."""
        return self.choice in ("required", "function")

    @property
    def forced_tools(self) -> tuple[ToolSpec, ...]:
        if self.choice == "function":
            return tuple(t for t in self.tools if t.name == self.function_name)
        return self.tools

    def template_tools(self) -> list[dict[str, Any]] | None:
        """`tools=` for the template: none with choice "none" (the model is not told of them), as vLLM's
        `--exclude-tools-when-tool-choice-none` does, since it may not call them."""
        if self.choice == "none" or not self.tools:
            return None
        return [t.to_template() for t in self.tools]


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A call an assistant message made (in a request) or the model made (in a response)."""

    id: str
    name: str
    arguments: str  # JSON text, as OpenAI carries it

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def to_template(self) -> dict[str, Any]:
        """As templates read a past call: the arguments as an object when they are one (templates write
        them with `| tojson`, as vLLM gives them), else the text."""
        try:
            arguments: Any = json.loads(self.arguments)
        except ValueError:
            arguments = self.arguments
        if not isinstance(arguments, dict):
            arguments = self.arguments
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _name(value: Any, field: str) -> str:
    if not isinstance(value, str) or not TOOL_NAME.match(value):
        raise bad_request(
            f"'{field}' must be a function name of 1 to 64 letters, digits, '_', '.' or '-', got {value!r:.60}",
            field,
            "invalid_value",
        )
    return value


def parse_tool(item: Any, field: str, flat: bool = False) -> ToolSpec:
    """One tool definition: chat's {"type": "function", "function": {...}}, or with `flat` the Responses
    API's {"type": "function", "name", "parameters", ...}."""
    if not isinstance(item, dict):
        raise wrong_type(field, "an object", item)
    if item.get("type") != "function":
        raise bad_request(
            f"'{field}.type' must be 'function' (the only tool type served), got {item.get('type')!r:.40}",
            f"{field}.type",
            "invalid_value",
        )
    function: Any
    if flat:
        function, prefix = item, field
        known = {"type", "name", "description", "parameters", "strict"}
    else:
        function, prefix = item.get("function"), f"{field}.function"
        if not isinstance(function, dict):
            raise wrong_type(prefix, "an object with the function's 'name'", function)
        known = {"name", "description", "parameters", "strict"}
        if extra := sorted(set(item) - {"type", "function"}):
            raise bad_request(f"'{field}.{extra[0]}' is not a tool field", f"{field}.{extra[0]}", "unknown_parameter")
    if extra := sorted(set(function) - known):
        raise bad_request(f"'{prefix}.{extra[0]}' is not a function field", f"{prefix}.{extra[0]}", "unknown_parameter")
    name = _name(function.get("name"), f"{prefix}.name")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise wrong_type(f"{prefix}.description", "a string", description)
    parameters = function.get("parameters")
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, dict):
        raise wrong_type(f"{prefix}.parameters", "a JSON Schema object", parameters)
    if parameters.get("type", "object") != "object":
        raise bad_request(
            f"'{prefix}.parameters' must be a schema of type 'object' (arguments are a JSON object)",
            f"{prefix}.parameters",
            "invalid_value",
        )
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise wrong_type(f"{prefix}.strict", "a boolean", strict)
    return ToolSpec(name, description, json.dumps(parameters, ensure_ascii=False), strict)


def _choice(value: Any, names: set[str], flat: bool) -> tuple[str, str | None]:
    if value is None:
        return ("auto" if names else "none"), None
    if isinstance(value, str):
        if value not in CHOICE_MODES:
            raise bad_request(
                f"'tool_choice' must be one of {', '.join(CHOICE_MODES)} or a named function, got {value!r:.40}",
                "tool_choice",
                "invalid_value",
            )
        if value != "none" and not names:
            raise bad_request(f"'tool_choice' is '{value}' but the request has no 'tools'", "tool_choice")
        return value, None
    if not isinstance(value, dict) or value.get("type") != "function":
        raise wrong_type("tool_choice", "a string or {'type': 'function', ...}", value)
    holder = value if flat else value.get("function")
    field = "tool_choice.name" if flat else "tool_choice.function.name"
    if not isinstance(holder, dict):
        raise wrong_type("tool_choice.function", "an object with the function's 'name'", holder)
    name = _name(holder.get("name"), field)
    if not names:
        raise bad_request(f"'tool_choice' names the function '{name}' but the request has no 'tools'", "tool_choice")
    if name not in names:
        raise bad_request(
            f"'tool_choice' names the function '{name}', which is not among 'tools' ({', '.join(sorted(names))})",
            field,
            "invalid_value",
        )
    return "function", name


def parse_tool_request(body: Mapping[str, Any], flat: bool = False) -> ToolRequest | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body (Responses' shapes with `flat`);
    None when the request has no tools and no tool_choice that asks for one."""
    raw = body.get("tools")
    if raw is not None and not isinstance(raw, list):
        raise wrong_type("tools", "a list of tools", raw)
    tools = tuple(parse_tool(item, f"tools[{i}]", flat) for i, item in enumerate(raw or []))
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise bad_request(f"'tools' defines the function '{dup}' more than once", "tools", "invalid_value")
    choice, function_name = _choice(body.get("tool_choice"), set(names), flat)
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise wrong_type("parallel_tool_calls", "a boolean", parallel)
    if not tools:
        return None
    return ToolRequest(tools, choice, function_name, True if parallel is None else parallel)


def parse_message_tool_calls(value: Any, field: str) -> tuple[ToolCall, ...]:
    """An assistant message's `tool_calls`."""
    if not isinstance(value, list):
        raise wrong_type(field, "a list of tool calls", value)
    calls = []
    for i, call in enumerate(value):
        where = f"{field}[{i}]"
        if not isinstance(call, dict):
            raise wrong_type(where, "an object", call)
        if call.get("type", "function") != "function":
            raise bad_request(f"'{where}.type' must be 'function'", f"{where}.type", "invalid_value")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            raise wrong_type(f"{where}.id", "a non-empty string", call_id)
        function = call.get("function")
        if not isinstance(function, dict):
            raise wrong_type(f"{where}.function", "an object with 'name' and 'arguments'", function)
        name = _name(function.get("name"), f"{where}.function.name")
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise wrong_type(f"{where}.function.arguments", "a string of JSON", arguments)
        calls.append(ToolCall(call_id, name, arguments))
    return tuple(calls)


def parse_tool_call_id(value: Any, field: str) -> str:
    if value is None:
        raise bad_request(
            f"'{field}' is required: a tool message answers the tool call of that id", field, "missing_required"
        )
    if not isinstance(value, str) or not value:
        raise wrong_type(field, "a non-empty string", value)
    return value
