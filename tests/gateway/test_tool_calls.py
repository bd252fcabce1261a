"""Tool calling, reasoning and special tokens in content, as pure units: the request's tools, the
output parsers (whole and streamed), the constraint grammars (checked with llguidance itself), the
Granite-style template against transformers, and content's special-token text kept literal."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.api_errors import ApiError
from gateway.chat_output import OutputParser, chat_deltas, chat_message
from gateway.chat_template import ChatTemplate, load_chat_template
from gateway.openai_request import parse_chat
from gateway.reasoning import ReasoningSplitter, pick_reasoning_parser, prompt_opens_reasoning
from gateway.tokens import GatewayTokenizer
from gateway.tool_calls import parse_tool_request
from gateway.tool_constraint import tool_constraint, tool_grammar, tool_json_schema
from gateway.tool_parsers import make_parser, pick_parser
from hybridserve_cli.chat_templates import GRANITE, add_chat_template
from hybridserve_cli.demo_model.default import CHAT_TEMPLATE as DEMO_TEMPLATE
from hybridserve_cli.init_model import write_random_checkpoint

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["C", "F"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}


def chat(**fields):
    return parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields})


def rejected(**fields) -> ApiError:
    with pytest.raises(ApiError) as exc:
        chat(**fields)
    assert exc.value.status == 400
    return exc.value


def test_tool_request_is_validated():
    api = chat(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert api.tools is not None and api.tools.choice == "function" and api.tools.function_name == "get_time"
    assert [t.name for t in api.tools.forced_tools] == ["get_time"] and api.tools.parallel
    assert chat(tools=[WEATHER]).tools.choice == "auto"
    assert chat(tool_choice="none").tools is None  # no tools, nothing to refuse
    assert rejected(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}).param == (
        "tool_choice.function.name"
    )
    assert rejected(tool_choice="required").param == "tool_choice"
    assert rejected(tool_choice={"type": "function", "function": {"name": "get_time"}}).param == "tool_choice"
    assert rejected(tools=[{"type": "function", "function": {"description": "no name"}}]).param == (
        "tools[0].function.name"
    )
    assert rejected(tools=[{"type": "code_interpreter"}]).param == "tools[0].type"
    assert rejected(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}]).param == (
        "tools[0].function.parameters"
    )
    assert rejected(tools=[WEATHER, WEATHER]).param == "tools"
    assert rejected(tools=[WEATHER], parallel_tool_calls="yes").param == "parallel_tool_calls"


def test_tool_messages_are_validated():
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    ok = parse_chat(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "time?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_1", "content": "noon"},
            ],
        }
    )
    assert ok.messages[1].tool_calls[0].name == "get_time" and ok.messages[1].null_content
    assert ok.messages[2].tool_call_id == "call_1"
    for messages, param in [
        ([{"role": "tool", "content": "noon"}], "messages[0].tool_call_id"),
        ([{"role": "user", "content": "x", "tool_calls": [call]}], "messages[0].tool_calls"),
        ([{"role": "assistant", "tool_calls": [{**call, "function": {"name": "f", "arguments": {}}}]}], None),
    ]:
        with pytest.raises(ApiError) as exc:
            parse_chat({"model": "m", "messages": messages})
        assert exc.value.status == 400 and (param is None or exc.value.param == param)


def run(parser_name: str | None, text: str, step: int, reasoning: bool = False, starts_inside: bool = False):
    """The parsed message and the stream's deltas, with the text fed `step` characters at a time."""
    output = OutputParser(
        ReasoningSplitter(starts_inside) if reasoning else None,
        make_parser(parser_name) if parser_name else None,
    )
    deltas = []
    for i in range(0, len(text), step):
        before = len(output.calls)
        deltas += chat_deltas(output.feed(text[i : i + step]), before)
    before = len(output.calls)
    deltas += chat_deltas(output.finish(), before)
    return chat_message(output), deltas


def merged(deltas):
    """What the openai client makes of a stream's deltas."""
    content, reasoning, calls = "", "", {}
    for d in deltas:
        content += d.get("content", "")
        reasoning += d.get("reasoning_content", "")
        for c in d.get("tool_calls", []):
            entry = calls.setdefault(c["index"], {"id": None, "name": "", "arguments": ""})
            entry["id"] = c.get("id", entry["id"])
            entry["name"] += c.get("function", {}).get("name", "")
            entry["arguments"] += c["function"].get("arguments", "")
    return content, reasoning, [calls[i] for i in sorted(calls)]


CASES = [
    (
        "granite",
        'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me look.",
        [("get_weather", {"city": "Oslo", "unit": "C"}), ("get_time", {})],
    ),
    (
        "nemotron_h",
        '<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}, '
        '{"name": "get_time", "arguments": "{}"}]</TOOLCALL>',
        None,
        [("get_weather", {"city": "Oslo", "unit": "C"}), ("get_time", {})],
    ),
    ("json", ' {"name": "get_time", "parameters": {}}', None, [("get_time", {})]),
    ("json", "plain {text}", "plain {text}", []),
    ("granite", "a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
    ("granite", 'cut off <tool_call>\n{"name": "get_ti', 'cut off <tool_call>\n{"name": "get_ti', []),
    ("granite", '<tool_call>\n{"name": "get_time", "arguments": {}}', None, [("get_time", {})]),  # EOS after JSON
    ("granite", "a < b <tool", "a < b <tool", []),  # a held-back marker prefix that never completes
]


@pytest.mark.parametrize(("name", "text", "content", "calls"), CASES)
@pytest.mark.parametrize("step", [1, 3, 1000])
def test_parsers_whole_and_streamed(name, text, content, calls, step):
    message, deltas = run(name, text, step)
    assert message["content"] == content
    found = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"] or []]
    assert found == calls
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in message["tool_calls"] or [])
    streamed_content, _, streamed_calls = merged(deltas)
    assert streamed_content == (content or "")
    assert [(c["name"], json.loads(c["arguments"])) for c in streamed_calls] == calls
    assert [c["id"] for c in streamed_calls] == [c["id"] for c in message["tool_calls"] or []]


def test_a_call_streams_its_name_before_its_arguments():
    _, deltas = run("granite", '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>', 1000)
    head, args = (d["tool_calls"][0] for d in deltas)
    assert head["function"] == {"name": "get_time", "arguments": ""} and head["id"].startswith("call_")
    assert args == {"index": 0, "function": {"arguments": "{}"}}


def test_parallel_false_keeps_the_first_call():
    output = OutputParser(None, make_parser("granite"), parallel=False)
    output.feed('<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}')
    output.finish()
    assert [c.name for c in output.calls] == ["a"]


def test_parser_is_picked_from_the_template():
    assert pick_parser("auto", GRANITE) == "granite" and pick_parser("auto", DEMO_TEMPLATE) == "granite"
    assert pick_parser("auto", "<TOOLCALL>{{ x }}</TOOLCALL>") == "nemotron_h"
    assert pick_parser("auto", "{{ messages }}") == pick_parser("auto", None) == "json"
    assert pick_parser("hermes", None) == "granite"
    with pytest.raises(ValueError):
        pick_parser("llama3", None)


@pytest.mark.parametrize("step", [1, 2, 1000])
def test_reasoning_split(step):
    text = "<think>\nfirst, think</think>\n\nThe answer."
    message, deltas = run(None, text, step, reasoning=True)
    assert (message["reasoning_content"], message["content"]) == ("\nfirst, think", "The answer.")
    assert merged(deltas)[:2] == ("The answer.", "\nfirst, think")
    # the template opened the block: reasoning from the first character
    message, _ = run(None, "plan</think>done", step, reasoning=True, starts_inside=True)
    assert (message["reasoning_content"], message["content"]) == ("plan", "done")
    message, _ = run(None, "no thinking here", step, reasoning=True)
    assert (message["reasoning_content"], message["content"]) == (None, "no thinking here")
    # reasoning, then a tool call in what follows it
    message, deltas = run(
        "granite", 'hm</think><tool_call>{"name": "f", "arguments": {}}</tool_call>', step, True, True
    )
    assert message["reasoning_content"] == "hm" and message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "f"


def test_reasoning_parser_choice():
    assert prompt_opens_reasoning("<|assistant|><think>\n") and not prompt_opens_reasoning("<think></think>x")
    assert pick_reasoning_parser("auto", "...<think>...") == "deepseek_r1"
    assert pick_reasoning_parser("auto", "plain") == "" and pick_reasoning_parser("none", "<think>") == ""
    with pytest.raises(ValueError):
        pick_reasoning_parser("r2", None)


@pytest.fixture(scope="module")
def granite_model(tmp_path_factory) -> Path:
    root = write_random_checkpoint(tmp_path_factory.mktemp("granite") / "m", seed=1)
    add_chat_template(root, "granite")
    return root


def test_constraint_grammars_accept_exactly_well_formed_calls(granite_model):
    llguidance = pytest.importorskip("llguidance")
    tokenizer = GatewayTokenizer.from_model_dir(granite_model)
    assert tokenizer is not None
    ll_tokenizer = llguidance.LLTokenizer((granite_model / "tokenizer.json").read_text())
    tools = parse_tool_request({"tools": [WEATHER, TIME], "tool_choice": "required"})
    named = parse_tool_request(
        {"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    )

    def accepts(grammar: str, text: str) -> bool:
        assert llguidance.LLMatcher.validate_grammar(grammar, ll_tokenizer) == ""
        matcher = llguidance.LLMatcher(ll_tokenizer, grammar, log_level=0)
        return matcher.consume_tokens(tokenizer.encode(text, add_special_tokens=False)) and matcher.is_accepting()

    weather = '{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}'
    granite = tool_grammar(tools, "granite")
    assert accepts(granite, f"<tool_call>\n{weather}\n</tool_call>")
    assert accepts(
        granite,
        f'<tool_call>\n{weather}\n</tool_call>\n<tool_call>\n{{"name": "get_time", "arguments": {{}}}}\n</tool_call>',
    )
    assert not accepts(granite, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    assert not accepts(
        granite, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "K"}}\n</tool_call>'
    )
    assert not accepts(granite, "Sure!")
    assert not accepts(
        tool_grammar(named, "granite"), '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    )
    assert accepts(
        tool_grammar(tools, "nemotron_h"),
        f'<TOOLCALL>[{weather}, {{"name": "get_time", "arguments": {{}}}}]</TOOLCALL>',
    )
    # what the grammar lets through, the parser reads back
    message, _ = run("granite", f"<tool_call>\n{weather}\n</tool_call>", 1)
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Oslo", "unit": "C"}
    schema = tool_json_schema(named)
    assert schema["properties"]["name"] == {"const": "get_weather"}
    assert tool_constraint(named, "json").WhichOneof("kind") == "json_schema"
    assert tool_constraint(parse_tool_request({"tools": [WEATHER]}), "granite") is None  # auto: unconstrained


def test_a_forced_tool_whose_schema_the_engine_cannot_compile_is_a_400_naming_it():
    pytest.importorskip("llguidance")
    bad = {"type": "function", "function": {"name": "broken", "parameters": {"type": "object", "$ref": "#/nowhere"}}}
    for parser in ("granite", "nemotron_h", "json"):
        with pytest.raises(ApiError) as caught:
            tool_constraint(parse_tool_request({"tools": [WEATHER, bad], "tool_choice": "required"}), parser)
        assert caught.value.status == 400 and caught.value.body()["error"]["param"] == "tools[1]"
    # not forced, or forced to the other tool: the broken schema is never compiled
    assert tool_constraint(parse_tool_request({"tools": [WEATHER, bad]}), "granite") is None
    named = {"type": "function", "function": {"name": "get_weather"}}
    assert tool_constraint(parse_tool_request({"tools": [WEATHER, bad], "tool_choice": named}), "granite")


def test_granite_template_renders_tools_as_transformers_does(granite_model):
    transformers = pytest.importorskip("transformers")
    call = {
        "id": "call_7",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "C"}'},
    }
    body = {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo? ü"},
            {"role": "assistant", "content": None, "tool_calls": [call, {**call, "id": "call_8"}]},
            {"role": "tool", "tool_call_id": "call_7", "content": '{"temp": 4}'},
            {"role": "tool", "tool_call_id": "call_8", "content": '{"temp": 5}'},
            {"role": "assistant", "content": "4 degrees."},
            {"role": "user", "content": "Thanks"},
        ],
        "tools": [WEATHER, TIME],
    }
    api = parse_chat(body)
    template = load_chat_template(granite_model)
    assert template is not None
    ours = template.render(api.messages, api.tools.template_tools())
    oracle_messages = json.loads(json.dumps(body["messages"]))
    for m in oracle_messages:  # past calls' arguments as objects, as the server gives them to templates
        for c in m.get("tool_calls", []):
            c["function"]["arguments"] = json.loads(c["function"]["arguments"])
    oracle = transformers.AutoTokenizer.from_pretrained(str(granite_model)).apply_chat_template(
        oracle_messages, tools=body["tools"], tokenize=False, add_generation_prompt=True
    )
    assert ours == oracle
    assert "<tools>" in ours and '<tool_response>\n{"temp": 4}\n</tool_response>\n<tool_response>' in ours
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "unit": "C"}}\n</tool_call>' in ours
    plain = template.render(parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).messages)
    assert plain == "<|start_of_role|>user<|end_of_role|>hi<|eos|>\n<|start_of_role|>assistant<|end_of_role|>"


def test_special_tokens_in_content_stay_text(granite_model):
    tokenizer = GatewayTokenizer.from_model_dir(granite_model)
    assert tokenizer is not None and "<|eos|>" in tokenizer.special_token_texts
    template = ChatTemplate.compile("{% for m in messages %}<|bos|>{{ m['content'] | trim }}<|eos|>{% endfor %}", {})
    messages = parse_chat({"model": "m", "messages": [{"role": "user", "content": " say <|eos|> now "}]}).messages
    prompt = template.render_prompt(messages, None, tokenizer.special_token_texts)
    assert prompt.text == "<|bos|>say <|eos|> now<|eos|>"
    start = prompt.text.index("<|eos|>")
    assert prompt.literal_spans == ((start, start + 7),)
    ids = tokenizer.encode_chat(prompt)
    eos = tokenizer.encode("<|eos|>", add_special_tokens=False)
    assert eos == [2] and ids.count(2) == 1 and ids[-1] == 2  # only the template's own EOS is EOS
    assert ids == [
        1,
        *tokenizer.encode("say ", False),
        *_literal(tokenizer, "<|eos|>"),
        *tokenizer.encode(" now", False),
        2,
    ]
    old = template.render_prompt(messages, None, ())  # --allow-special-tokens-in-content
    assert old.literal_spans == () and tokenizer.encode_chat(old).count(2) == 2
    upper = ChatTemplate.compile("{% for m in messages %}{{ m['content'] | upper }}{% endfor %}", {})
    with pytest.raises(ApiError) as exc:  # a template that rewrites content: refused rather than guessed
        upper.render_prompt(messages, None, tokenizer.special_token_texts)
    assert exc.value.param == "messages"


def test_literal_spans_keep_the_checkpoints_added_special_tokens_around_the_whole(granite_model):
    """/tokenize's add_special_tokens on a chat: the post-processor's BOS goes before the whole prompt once,
    not before each of the pieces the literal spans cut it into."""
    from tokenizers import Tokenizer
    from tokenizers.processors import TemplateProcessing

    raw = Tokenizer.from_file(str(granite_model / "tokenizer.json"))
    raw.post_processor = TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 1)])
    tokenizer = GatewayTokenizer(raw)
    template = ChatTemplate.compile("{% for m in messages %}{{ m['content'] }}<|eos|>{% endfor %}", {})
    messages = parse_chat({"model": "m", "messages": [{"role": "user", "content": "a <|eos|> b"}]}).messages
    prompt = template.render_prompt(messages, None, tokenizer.special_token_texts)
    assert prompt.literal_spans
    bare = tokenizer.encode_chat(prompt)
    assert bare[0] != 1 and tokenizer.encode_chat(prompt, add_special_tokens=True) == [1, *bare]


def _literal(tokenizer: GatewayTokenizer, text: str) -> list[int]:
    return [i for ch in text.encode() for i in tokenizer.encode(chr(ch), False)]
