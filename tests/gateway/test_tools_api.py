"""Tool calls, /v1/responses and special tokens in content with the official OpenAI client, through a real
gateway started without --model (it takes the template and tokenizer from its workers) in front of real
workers serving a tiny random model with a Granite-style chat template.

A random model never calls a tool of its own accord, so `tool_choice: auto` is checked for what reaches
the model (the rendered tools) and for a stream that says what the body says; well-formed calls come from
`required` and named choices, which the worker's structured-output engine guarantees."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import jsonschema
import openai
import pytest

from gateway.chat_template import load_chat_template
from gateway.openai_request import parse_chat
from gateway.tokens import GatewayTokenizer
from hybridserve_cli.chat_templates import add_chat_template
from hybridserve_cli.init_model import write_random_checkpoint
from tests.gateway.conftest import MODEL_NAME, SPEC, Stack, gateway_stack, start_gateway, wait_ready

pytestmark = pytest.mark.slow

PARAMETERS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["C", "F"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMETERS}}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
}
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def granite_dir(tmp_path_factory) -> Path:
    root = write_random_checkpoint(tmp_path_factory.mktemp("tools-model") / "tiny", SPEC, seed=3)
    add_chat_template(root, "granite")
    return root


@pytest.fixture(scope="module")
def tools_stack(granite_dir, scheduler) -> Iterator[Stack]:
    with gateway_stack(granite_dir, scheduler, gateway_model=False) as s:
        yield s


@pytest.fixture(scope="module")
def client(tools_stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=tools_stack.base_url, api_key="unused", max_retries=0, timeout=120)


def prompt_tokens(model_dir: Path, body: dict) -> int:
    """What the gateway should send: our rendering of the chat body, literal content kept literal."""
    api = parse_chat({"model": MODEL_NAME, **body})
    template = load_chat_template(model_dir)
    tokenizer = GatewayTokenizer.from_model_dir(model_dir)
    assert template is not None and tokenizer is not None
    tools = api.tools.template_tools() if api.tools else None
    return len(tokenizer.encode_chat(template.render_prompt(api.messages, tools, tokenizer.special_token_texts)))


def test_auto_renders_the_tools_and_streams_what_the_body_says(client, granite_dir):
    body = {"messages": ASK, "tools": [WEATHER, TIME]}
    kwargs = dict(model=MODEL_NAME, max_tokens=12, temperature=0, **body)
    result = client.chat.completions.create(**kwargs)
    assert result.usage.prompt_tokens == prompt_tokens(granite_dir, body)
    without = client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=1, temperature=0)
    assert result.usage.prompt_tokens > without.usage.prompt_tokens + 100  # the tools' schemas are in the prompt
    choice = result.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    stream = client.chat.completions.create(**kwargs, stream=True)
    content, calls = "", []
    for chunk in stream:
        for c in chunk.choices:
            content += c.delta.content or ""
            calls += c.delta.tool_calls or []
    assert content == (choice.message.content or "")
    assert len({c.index for c in calls}) == len(choice.message.tool_calls or [])


def test_tool_results_reach_the_template(client, granite_dir):
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'},
    }
    body = {
        "messages": [*ASK, {"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"}],
        "tools": [WEATHER],
    }  # fmt: skip
    result = client.chat.completions.create(model=MODEL_NAME, max_tokens=2, temperature=0, **body)
    assert result.usage.prompt_tokens == prompt_tokens(granite_dir, body)


def test_special_tokens_in_content_are_text(client, granite_dir):
    body = {"messages": [{"role": "user", "content": "stop <|eos|> here"}]}
    result = client.chat.completions.create(model=MODEL_NAME, max_tokens=1, temperature=0, **body)
    plain = client.chat.completions.create(
        model=MODEL_NAME, max_tokens=1, temperature=0, messages=[{"role": "user", "content": "stop  here"}]
    )
    # the byte tokenizer: literal "<|eos|>" is 7 tokens; the special token would be 1
    assert result.usage.prompt_tokens == plain.usage.prompt_tokens + 7 == prompt_tokens(granite_dir, body)


def post_json(stack: Stack, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(
        f"http://{stack.gateway.address}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_tokenize_renders_the_tools_and_keeps_content_literal(tools_stack, granite_dir):
    """/tokenize with messages and tools gives the ids a chat request with the same body is served on."""
    body = {"messages": [{"role": "user", "content": "stop <|eos|> here"}], "tools": [WEATHER]}
    status, result = post_json(tools_stack, "/tokenize", {"model": MODEL_NAME, **body})
    assert status == 200 and result["count"] == len(result["tokens"]) == prompt_tokens(granite_dir, body), result
    _, bare = post_json(tools_stack, "/tokenize", {"model": MODEL_NAME, "messages": body["messages"]})
    assert bare["count"] < result["count"] - 100  # the tools' schemas are in the prompt
    status, refused = post_json(tools_stack, "/tokenize", {"model": MODEL_NAME, "prompt": "x", "tools": [WEATHER]})
    assert status == 400 and refused["error"]["param"] == "tools"


def check_call(call, name: str = "get_weather") -> None:
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == name
    jsonschema.validate(json.loads(call.function.arguments), PARAMETERS if name == "get_weather" else {})


@pytest.mark.parametrize("seed", [1, 2])
def test_required_gives_valid_calls(client, seed):
    result = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER], tool_choice="required", temperature=0.8, seed=seed,
        max_tokens=200, parallel_tool_calls=False,
    )  # fmt: skip
    choice = result.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert len(choice.message.tool_calls) == 1
    check_call(choice.message.tool_calls[0])


def test_named_call_streamed(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=ASK, tools=[WEATHER, TIME], temperature=0.8, seed=5, max_tokens=200, stream=True,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )  # fmt: skip
    deltas, finish = [], None
    for chunk in stream:
        for c in chunk.choices:
            deltas += c.delta.tool_calls or []
            finish = c.finish_reason or finish
    assert finish == "tool_calls"
    head = deltas[0]
    assert head.index == 0 and head.id.startswith("call_") and head.function.name == "get_weather"
    arguments = "".join(d.function.arguments or "" for d in deltas)
    jsonschema.validate(json.loads(arguments), PARAMETERS)


def test_continuous_usage_rides_on_every_tool_call_delta(tools_stack):
    """One worker message can make several chunks (a call's name, then its arguments): each carries the
    usage so far (stream_options.continuous_usage_stats)."""
    body = {"model": MODEL_NAME, "messages": ASK, "tools": [WEATHER], "max_tokens": 200, "temperature": 0,
            "tool_choice": {"type": "function", "function": {"name": "get_weather"}}, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}  # fmt: skip
    request = urllib.request.Request(
        f"http://{tools_stack.gateway.address}/v1/chat/completions", json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as response:
        events = [e for e in response.read().decode().split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    *chunks, last = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    calls = [c for c in chunks if c["choices"][0]["delta"].get("tool_calls")]
    assert len(calls) == 2 and calls[0]["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert calls[-1]["choices"][0]["finish_reason"] == "tool_calls"
    counts = [c["usage"]["completion_tokens"] for c in chunks]
    assert counts == sorted(counts) and counts[-1] == last["usage"]["completion_tokens"] > 0
    assert calls[0]["usage"] == calls[1]["usage"]  # both from the last worker message
    assert all(c["usage"]["prompt_tokens"] == last["usage"]["prompt_tokens"] for c in chunks)


def test_bad_tool_requests_are_400s(client):
    cases = [
        (
            dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}),
            "tool_choice.function.name",
        ),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools[0].function.name"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        (
            dict(
                tools=[WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"$ref": "#/no"}}}],
                tool_choice={"type": "function", "function": {"name": "f"}},
            ),
            "tools[1]",
        ),
    ]
    for extra, param in cases:
        with pytest.raises(openai.BadRequestError) as exc:
            client.chat.completions.create(model=MODEL_NAME, messages=ASK, max_tokens=1, **extra)
        assert exc.value.body["param"] == param
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=MODEL_NAME, max_tokens=1, messages=[*ASK, {"role": "tool", "content": "x"}]
        )
    assert exc.value.body["param"] == "messages[1].tool_call_id"


RESPONSES_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather",
    "parameters": PARAMETERS,
    "strict": True,
}


def test_responses_round_trip_with_a_tool(client, granite_dir):
    """The Agents SDK's second turn: the call it made and its result go back as input items."""
    items = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "get_weather",
         "arguments": '{"city": "Oslo", "unit": "C"}', "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "4 degrees"},
    ]  # fmt: skip
    kwargs = dict(
        model=MODEL_NAME,
        instructions="Be brief.",
        input=items,
        tools=[RESPONSES_TOOL],
        max_output_tokens=6,
        temperature=0,
    )
    response = client.responses.create(**kwargs)
    assert response.object == "response" and response.status in ("completed", "incomplete")
    chat_body = {
        "messages": [{"role": "system", "content": "Be brief."}, items[0],
                     {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                      "function": {"name": "get_weather", "arguments": items[1]["arguments"]}}]},
                     {"role": "tool", "tool_call_id": "call_1", "content": "4 degrees"}],
        "tools": [WEATHER],
    }  # fmt: skip
    assert response.usage.input_tokens == prompt_tokens(granite_dir, chat_body)
    assert response.usage.output_tokens <= 6 and response.tools[0].name == "get_weather"
    text = "".join(i.content[0].text for i in response.output if i.type == "message")
    assert response.output_text == text
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == f"response.{response.status}"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_function_call(client):
    kwargs = dict(model=MODEL_NAME, input="Weather in Oslo?", tools=[RESPONSES_TOOL], tool_choice="required",
                  parallel_tool_calls=False, max_output_tokens=200, temperature=0.8)  # fmt: skip
    response = client.responses.create(**kwargs)
    calls = [i for i in response.output if i.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    jsonschema.validate(json.loads(calls[0].arguments), PARAMETERS)
    events = list(client.responses.create(**kwargs, stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
    added = next(e for e in events if e.type == "response.output_item.added" and e.item.type == "function_call")
    arguments = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert added.item.name == "get_weather"
    jsonschema.validate(json.loads(arguments), PARAMETERS)


def test_responses_refuses_what_it_cannot_do(client):
    for extra, param in [
        (dict(previous_response_id="resp_1"), "previous_response_id"),
        (dict(store=True), "store"),
        (dict(tools=[RESPONSES_TOOL], tool_choice={"type": "function", "name": "nope"}), "tool_choice.name"),
        (dict(input=[{"type": "image_generation_call"}]), "input[0].type 'image_generation_call'"),
    ]:
        kwargs = {"input": "hi"} | extra
        with pytest.raises(openai.BadRequestError) as exc:
            client.responses.create(model=MODEL_NAME, max_output_tokens=2, **kwargs)
        assert exc.value.body["param"] == param, exc.value.body
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model=MODEL_NAME, input="hi", max_output_tokens=2, previous_response_id="resp_1")
    assert "stores no responses" in exc.value.body["message"]


def test_reasoning_is_split_from_content(tools_stack, granite_dir, tmp_path):
    """A template that opens `<think>` for the model: what the model writes until `</think>` (here all of
    it: a random model does not close the block) is reasoning_content, streamed as delta.reasoning_content."""
    template = tmp_path / "think.jinja"
    template.write_text(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}<|assistant|><think>\n"
    )
    with start_gateway(tools_stack.worker_addresses, granite_dir, "--chat-template", str(template)) as gateway:
        wait_ready(gateway, 2)
        client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0, timeout=120)
        kwargs = dict(model=MODEL_NAME, messages=ASK, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        result = client.chat.completions.create(**kwargs)
        message = result.choices[0].message
        assert message.content is None and message.reasoning_content and result.usage.completion_tokens == 8
        reasoning, content = "", ""
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                reasoning += c.delta.model_extra.get("reasoning_content") or ""
                content += c.delta.content or ""
        assert reasoning and content == ""
