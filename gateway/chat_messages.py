"""Chat messages as the OpenAI API sends them: `messages` parsed into `Message`s (a role, text content,
an assistant's tool calls, a tool message's call id), every bad message a 400 naming its index and field.
Rendered by the chat template (gateway/chat_template.py)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gateway.api_errors import bad_request, unsupported, utf8_text, wrong_type
from gateway.tool_calls import ToolCall, parse_message_tool_calls, parse_tool_call_id

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant message's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    name: str | None = None
    null_content: bool = False  # content was null (an assistant turn of only tool calls): the template sees None


def _content(value: Any, index: int) -> str:
    """A message's content: a string, or a list of text parts (other part types are refused)."""
    name = f"messages[{index}].content"
    if value is None:
        return ""
    if isinstance(value, str):
        return utf8_text(value, name)
    if not isinstance(value, list):
        raise wrong_type(name, "a string or a list of content parts", value)
    texts = []
    for part in value:
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise wrong_type(name, "a list of content parts ({'type': 'text', 'text': ...})", part)
        if part["type"] != "text":
            raise unsupported(f"{name} part of type '{part['type']}'", "only text parts are served")
        if not isinstance(part.get("text"), str):
            raise wrong_type(f"{name}.text", "a string", part.get("text"))
        texts.append(utf8_text(part["text"], f"{name}.text"))
    return "".join(texts)


def parse_messages(body: Mapping[str, Any]) -> tuple[Message, ...]:
    raw = body.get("messages")
    if raw is None:
        raise bad_request("'messages' is required", "messages", "missing_required")
    if not isinstance(raw, list) or not raw:
        raise wrong_type("messages", "a non-empty list of messages", raw)
    messages = []
    for i, item in enumerate(raw):
        if not isinstance(item, dict):
            raise wrong_type(f"messages[{i}]", "an object", item)
        role = item.get("role")
        if role not in CHAT_ROLES:
            raise bad_request(
                f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, got {role!r:.40}",
                f"messages[{i}].role",
                "invalid_value",
            )
        for key in item:
            if key not in ("role", "content", "name", "tool_calls", "tool_call_id"):
                raise unsupported(f"messages[{i}].{key}")
        messages.append(_message(item, str(role), i))
    return tuple(messages)


def _message(item: Mapping[str, Any], role: str, i: int) -> Message:
    """One message, with an assistant's `tool_calls` and a tool message's `tool_call_id`."""
    tool_calls: tuple[ToolCall, ...] = ()
    if item.get("tool_calls") is not None:
        if role != "assistant":
            raise bad_request(
                f"messages[{i}].tool_calls: only assistant messages make tool calls", f"messages[{i}].tool_calls"
            )
        tool_calls = parse_message_tool_calls(item["tool_calls"], f"messages[{i}].tool_calls")
    tool_call_id = None
    if role == "tool":
        tool_call_id = parse_tool_call_id(item.get("tool_call_id"), f"messages[{i}].tool_call_id")
    elif item.get("tool_call_id") is not None:
        raise bad_request(
            f"messages[{i}].tool_call_id: only tool messages answer a tool call", f"messages[{i}].tool_call_id"
        )
    name = item.get("name")
    if name is not None and not isinstance(name, str):
        raise wrong_type(f"messages[{i}].name", "a string", name)
    content = item.get("content")
    return Message(role, _content(content, i), tool_calls, tool_call_id, name, content is None)
