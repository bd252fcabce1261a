"""gateway/structured.py: the body's structured-output fields into a spec (a 400 naming the field for a
spec the engine cannot compile), the spec into the gRPC message, and the tool-call grammar helper."""

from __future__ import annotations

import pytest

from gateway.api_errors import ApiError
from gateway.openai_request import parse_chat, parse_completion
from gateway.structured import structured_output_pb, tool_call_output
from hybridserve.structured_output import StructuredSpec

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "strnig"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}, "extra": 1}}},
         "response_format.json_schema.extra"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"structured_outputs": {"regex": "a("}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: nowhere"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"json": "{no"}}, "structured_outputs.json"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
        ({"structured_outputs": {"choice": ["a"], "regex": "b"}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs"),
    ],
)  # fmt: skip
def test_bad_specs_are_400s_naming_the_field(fields, param) -> None:
    for parse, body in ((parse_chat, CHAT), (parse_completion, {"model": "m", "prompt": "x"})):
        with pytest.raises(ApiError) as caught:
            parse({**body, **fields})
        assert caught.value.body()["error"]["param"] == param and caught.value.status == 400


def test_specs_map_to_the_grpc_field() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": schema, "strict": True}}
    api = parse_chat({**CHAT, "response_format": response_format})
    assert structured_output_pb(api.structured).WhichOneof("kind") == "json_schema"
    vllm = {"choice": ["a", "b"], "disable_any_whitespace": False}
    api = parse_completion({"model": "m", "prompt": "x", "structured_outputs": vllm})
    message = structured_output_pb(api.structured)
    assert list(message.choice.values) == ["a", "b"]
    assert parse_chat({**CHAT, "response_format": {"type": "text"}}).structured is None
    assert parse_chat({**CHAT, "structured_outputs": {"json": schema, "disable_any_whitespace": False}}).structured == (
        StructuredSpec("json_schema", '{"type": "object", "properties": {"a": {"type": "integer"}}}', True)
    )


def test_tool_call_output_is_a_grammar_of_tagged_json_and_refuses_a_bad_schema() -> None:
    envelope = {"type": "object", "properties": {"name": {"const": "f"}, "arguments": {"type": "object"}},
                "required": ["name", "arguments"], "additionalProperties": False}  # fmt: skip
    message = tool_call_output(envelope, many=True)
    assert message.WhichOneof("kind") == "grammar" and "<tool_call>" in message.grammar and "%json" in message.grammar
    assert "<[7]>" in tool_call_output(envelope, "<[7]>", "<[8]>").grammar
    with pytest.raises(ApiError) as caught:
        tool_call_output({"$ref": "#/nowhere"})
    assert caught.value.body()["error"]["param"] == "tools"
