"""A /v1/responses body (OpenAI's Responses API, the Agents SDK's default) -> the chat request it means.
Pure: JSON in, `ApiRequest` out, `ApiError` (400) naming the Responses field for anything else.

`input` (a string, or a list of items: messages, `function_call` and `function_call_output` items, and
`reasoning` items, which are dropped as chat templates drop past reasoning) and `instructions` become chat
messages; `tools` in the Responses shape ({"type": "function", "name", "parameters"}) become chat tools;
`max_output_tokens`, `temperature`, `top_p` carry over. The chat body is then validated by the chat
parser, so both endpoints take the same requests. Nothing is stored: `previous_response_id`,
`conversation` and `store: true` are refused."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.api_errors import bad_request, unsupported, wrong_type
from gateway.openai_request import ApiRequest, parse_chat
from gateway.tool_calls import parse_tool, parse_tool_request

_FIELDS = frozenset(
    {
        "model",
        "input",
        "instructions",
        "tools",
        "tool_choice",
        "parallel_tool_calls",
        "max_output_tokens",
        "temperature",
        "top_p",
        "stream",
        "user",
        "metadata",
    }
)
# field -> values that change nothing here, accepted
_NO_OP: dict[str, tuple[Any, ...]] = {
    "store": (False,),
    "include": ([],),
    "text": ({"format": {"type": "text"}},),
    "reasoning": ({},),
    "truncation": ("disabled",),
    "service_tier": ("auto", "default"),
    "top_logprobs": (0,),
    "background": (False,),
}
_NOT_STORED = "this server stores no responses; send the whole conversation in 'input'"
_ROLES = ("user", "system", "developer", "assistant")


@dataclass(frozen=True, slots=True)
class ResponsesRequest:
    api: ApiRequest  # the chat request it runs as
    echo: dict[str, Any]  # request fields the response object repeats (instructions, tools, tool_choice, ...)


def _check_fields(body: Mapping[str, Any]) -> None:
    for name, value in body.items():
        if name in _FIELDS or value is None:
            continue
        if name in ("previous_response_id", "conversation"):
            raise bad_request(f"'{name}' is not supported: {_NOT_STORED}", name, "unsupported_parameter")
        if name == "store" and value is True:
            raise bad_request(f"'store': true is not supported: {_NOT_STORED}; send 'store': false", name)
        if name == "reasoning" and isinstance(value, dict) and all(v is None for v in value.values()):
            continue
        if name in _NO_OP:
            if value in _NO_OP[name]:
                continue
            raise unsupported(name)
        raise bad_request(f"unrecognized request argument supplied: '{name}'", name, "unknown_parameter")


def _text_of(content: Any, field: str, part_types: tuple[str, ...]) -> str:
    """A message's content: a string, or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise wrong_type(field, "a string or a list of content parts", content)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise wrong_type(f"{field}[{j}]", "a content part ({'type': 'input_text', 'text': ...})", part)
        if part["type"] not in part_types:
            raise unsupported(f"{field}[{j}] of type '{part['type']}'", "only text parts are served")
        if not isinstance(part.get("text"), str):
            raise wrong_type(f"{field}[{j}].text", "a string", part.get("text"))
        texts.append(part["text"])
    return "".join(texts)


def _string(item: Mapping[str, Any], key: str, field: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise wrong_type(f"{field}.{key}", "a non-empty string" if key != "arguments" else "a string", value)
    return value


def input_messages(value: Any) -> list[dict[str, Any]]:
    """`input` as chat messages: a function_call item joins the assistant message before it (a turn
    that spoke and called), else opens one of its own."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}]
    if not isinstance(value, list) or not value:
        raise wrong_type("input", "a string or a non-empty list of input items", value)
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(value):
        field = f"input[{i}]"
        if not isinstance(item, dict):
            raise wrong_type(field, "an object", item)
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in _ROLES:
                raise bad_request(
                    f"'{field}.role' must be one of {', '.join(_ROLES)}, got {role!r:.40}",
                    f"{field}.role",
                    "invalid_value",
                )
            parts = ("output_text", "refusal") if role == "assistant" else ("input_text", "text")
            text = _text_of(item.get("content"), f"{field}.content", (*parts, "input_text", "output_text"))
            messages.append({"role": role, "content": text})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", field),
                "type": "function",
                "function": {"name": _string(item, "name", field), "arguments": _string(item, "arguments", field)},
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text_of(output, f"{field}.output", ("input_text",))
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", field), "content": text})
        elif kind == "reasoning":
            continue  # the model's past reasoning: templates leave it out of the prompt
        else:
            raise unsupported(
                f"{field}.type '{kind}'", "input items are messages, function_call and function_call_output"
            )
    if not messages:
        raise bad_request("'input' holds no message", "input", "invalid_value")
    return messages


def _chat_tools(body: Mapping[str, Any]) -> list[dict[str, Any]] | None:
    raw = body.get("tools")
    if raw is None:
        return None
    if not isinstance(raw, list):
        raise wrong_type("tools", "a list of tools", raw)
    out = []
    for i, item in enumerate(raw):
        tool = parse_tool(item, f"tools[{i}]", flat=True)
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.parameters}
        if tool.description is not None:
            function["description"] = tool.description
        out.append({"type": "function", "function": function})
    return out


def _chat_tool_choice(value: Any) -> Any:
    if isinstance(value, dict) and value.get("type") == "function":
        return {"type": "function", "function": {"name": value.get("name")}}
    return value


def parse_responses(body: Any) -> ResponsesRequest:
    """POST /v1/responses."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_fields(body)
    parse_tool_request(body, flat=True)  # validated with the Responses API's field names
    messages = input_messages(body.get("input"))
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise wrong_type("instructions", "a string", instructions)
        messages.insert(0, {"role": "system", "content": instructions})
    max_output = body.get("max_output_tokens")
    if max_output is not None and (isinstance(max_output, bool) or not isinstance(max_output, int) or max_output < 1):
        raise bad_request(
            f"'max_output_tokens' must be a positive integer, got {max_output!r:.40}", "max_output_tokens"
        )
    chat: dict[str, Any] = {"model": body.get("model"), "messages": messages}
    for src, dst in (("temperature", "temperature"), ("top_p", "top_p"), ("stream", "stream"), ("user", "user")):
        if body.get(src) is not None:
            chat[dst] = body[src]
    if max_output is not None:
        chat["max_completion_tokens"] = max_output
    if (tools := _chat_tools(body)) is not None:
        chat["tools"] = tools
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _chat_tool_choice(body["tool_choice"])
    if body.get("parallel_tool_calls") is not None:
        chat["parallel_tool_calls"] = body["parallel_tool_calls"]
    api = parse_chat(chat)
    metadata = body.get("metadata")
    if metadata is not None and not isinstance(metadata, dict):
        raise wrong_type("metadata", "an object", metadata)
    echo = {
        "instructions": instructions,
        "max_output_tokens": max_output,
        "metadata": metadata or {},
        "parallel_tool_calls": api.tools.parallel if api.tools is not None else True,
        "temperature": body.get("temperature"),
        "tool_choice": body.get("tool_choice") or ("auto" if api.tools is not None else "none"),
        "tools": list(body.get("tools") or []),
        "top_p": body.get("top_p"),
        "user": body.get("user"),
    }
    return ResponsesRequest(api, echo)
