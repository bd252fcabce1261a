"""The OpenAI request parser, the response builders, the chat template and API keys: pure units."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gateway.api_errors import ApiError
from gateway.chat_messages import Message
from gateway.chat_template import ChatTemplate, load_chat_template
from gateway.convert import generate_requests
from gateway.openai_request import parse_chat, parse_completion
from gateway.openai_response import ChoiceState, UsageCount, final_body, openai_finish_reason, total_usage
from hybridserve.auth import bearer_token, is_authorized, load_keys
from hybridserve.v1 import generation_pb2 as pb


def rejected(parse, body) -> ApiError:
    with pytest.raises(ApiError) as exc:
        parse(body)
    assert exc.value.status == 400 and exc.value.message
    return exc.value


def test_completion_defaults_follow_openai():
    api = parse_completion({"model": "m", "prompt": "hi"})
    assert (api.max_tokens, api.n, api.stream) == (16, 1, False)
    assert (api.temperature, api.top_p, api.top_k) == (None, None, None)  # unset: filled in at convert
    sampling = generate_requests(api, "hi")[0].sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k) == (1.0, 1.0, 0)  # OpenAI's defaults
    assert api.prompt == "hi" and not api.logprobs
    assert parse_completion({"model": "m", "prompt": [5, 6, 7]}).prompt == (5, 6, 7)
    assert parse_completion({"model": "m", "prompt": ["one"]}).prompt == "one"


def test_chat_fields():
    api = parse_chat({"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "a"},
                      {"type": "text", "text": "b"}]}], "max_completion_tokens": 9, "max_tokens": 3,
                      "logprobs": True, "top_logprobs": 4, "stop": "x", "seed": 7, "stream": True,
                      "stream_options": {"include_usage": True}})  # fmt: skip
    assert api.messages == (Message("user", "ab"),)
    assert (api.max_tokens, api.top_logprobs, api.stop, api.seed, api.include_usage) == (9, 4, ("x",), 7, True)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "x"}, "model"),
        ({"model": 3, "prompt": "x"}, "model"),
        ({"model": "m", "prompt": "x", "max_tokens": 1.5}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": True}, "max_tokens"),
        ({"model": "m", "prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"model": "m", "prompt": "x", "temperature": 2.5}, "temperature"),
        ({"model": "m", "prompt": "x", "top_p": "high"}, "top_p"),
        ({"model": "m", "prompt": "x", "n": 0}, "n"),
        ({"model": "m", "prompt": "x", "n": 99}, "n"),
        ({"model": "m", "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "m", "prompt": "x", "stop": [""]}, "stop"),
        ({"model": "m", "prompt": "x", "stop": 5}, "stop"),
        ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"model": "m", "prompt": "x", "logprobs": 50}, "logprobs"),
        ({"model": "m", "prompt": "x", "echo": "yes"}, "echo"),
        ({"model": "m", "prompt": "x", "best_of": 3}, "best_of"),
        ({"model": "m", "prompt": "x", "logit_bias": {"five": 1}}, "logit_bias"),
        ({"model": "m", "prompt": "x", "frequency_penalty": 3}, "frequency_penalty"),
        ({"model": "m", "prompt": "x", "bogus": 1}, "bogus"),
        ({"model": "m", "prompt": ""}, "prompt"),
        ({"model": "m", "prompt": ["a", [1]]}, "prompt"),
        ({"model": "m", "prompt": ["a", ""]}, "prompt"),
        ({"model": "m", "prompt": [[1], []]}, "prompt"),
        ({"model": "m", "prompt": []}, "prompt"),
        ({"model": "m", "prompt": ["a"] * 129}, "prompt"),
        ({"model": "m", "prompt": ["a"] * 9, "n": 16}, "n"),
        ({"model": "m", "prompt": [1, "a"]}, "prompt"),
        ({"model": "m", "prompt": "x", "seed": "7"}, "seed"),
    ],
)
def test_bad_completion_fields_are_named(body, param):
    assert rejected(parse_completion, body).param == param


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": "m", "messages": []}, "messages"),
        ({"model": "m", "messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
         "messages[0].content part of type 'image_url'"),
        ({"model": "m", "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
         "tools[0].function"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "response_format": {"type": "xml"}},
         "response_format.type"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "top_logprobs"),
    ],
)  # fmt: skip
def test_bad_chat_fields_are_named(body, param):
    assert rejected(parse_chat, body).param == param


def test_no_op_values_of_unsupported_fields_pass():
    parse_chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "presence_penalty": 0, "tools": [],
                "response_format": {"type": "text"}, "tool_choice": None, "logit_bias": {}})  # fmt: skip


@given(st.dictionaries(st.text(max_size=8), st.one_of(st.none(), st.integers(), st.text(max_size=5), st.booleans(),
                       st.lists(st.integers(), max_size=3)), max_size=8))  # fmt: skip
def test_any_json_object_parses_or_fails_with_a_400(body):
    for parse in (parse_completion, parse_chat):
        try:
            parse({"model": "m", "prompt": "x", "messages": [{"role": "user", "content": "x"}], **body})
        except ApiError as exc:
            assert exc.status == 400 and exc.body()["error"]["message"]


def test_finish_reasons_in_openai_words():
    reasons = (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP, pb.FINISH_REASON_EOS, pb.FINISH_REASON_ABORT,
               pb.FINISH_REASON_ERROR, pb.FINISH_REASON_UNSPECIFIED)  # fmt: skip
    assert [openai_finish_reason(r) for r in reasons] == ["length", "stop", "stop", None, None, None]


def test_n_requests_get_consecutive_seeds():
    api = parse_completion({"model": "m", "prompt": [4, 5], "n": 3, "seed": 10, "temperature": 0.5, "stop": ["z"]})
    requests = generate_requests(api, (4, 5))
    assert [r.sampling.seed for r in requests] == [10, 11, 12]
    assert all(list(r.prompt_token_ids.ids) == [4, 5] and list(r.sampling.stop) == ["z"] for r in requests)
    assert not generate_requests(parse_completion({"model": "m", "prompt": "x"}), "x")[0].sampling.HasField("seed")


def _messages() -> list[pb.GenerateResponse]:
    first = pb.GenerateResponse(token_ids=[10, 11], logprobs=[-0.5, -1.0], text="ab")
    first.top_logprobs.add(token_ids=[10, 12], logprobs=[-0.5, -2.0])
    first.top_logprobs.add(token_ids=[11, 13], logprobs=[-1.0, -1.5])
    last = pb.GenerateResponse(token_ids=[12], logprobs=[-0.25], text="c", finish_reason=pb.FINISH_REASON_EOS)
    last.top_logprobs.add(token_ids=[12, 10], logprobs=[-0.25, -3.0])
    last.usage.CopyFrom(pb.Usage(prompt_tokens=7, cached_tokens=4, completion_tokens=3))
    return [first, last]


def text_of(token_id: int) -> str:
    return chr(ord("a") + token_id - 10)


def test_completion_choice_with_logprobs():
    choice = ChoiceState(0, "completion", want_logprobs=True, with_top=True, token_text=text_of)
    chunks = [choice.apply(m) for m in _messages()]
    assert [c["text"] for c in chunks] == ["ab", "c"] and chunks[-1]["finish_reason"] == "stop"
    assert chunks[1]["logprobs"]["text_offset"] == [2]
    body = final_body("completion", "cmpl-1", "m", [choice])
    assert body["choices"][0]["logprobs"] == {"tokens": ["a", "b", "c"], "token_logprobs": [-0.5, -1.0, -0.25],
        "top_logprobs": [{"a": -0.5, "c": -2.0}, {"b": -1.0, "d": -1.5}, {"c": -0.25, "a": -3.0}],
        "text_offset": [0, 1, 2]}  # fmt: skip
    assert body["usage"] == {"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10,
                             "prompt_tokens_details": {"cached_tokens": 4}}  # fmt: skip


def test_chat_choice_stream_and_body():
    choice = ChoiceState(0, "chat", want_logprobs=True, with_top=True, token_text=text_of)
    chunks = [choice.apply(m) for m in _messages()]
    assert chunks[0]["delta"] == {"role": "assistant", "content": "ab"} and chunks[1]["delta"] == {"content": "c"}
    content = chunks[0]["logprobs"]["content"]
    assert content[0] == {"token": "a", "logprob": -0.5, "bytes": [97],
                          "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]},
                                           {"token": "c", "logprob": -2.0, "bytes": [99]}]}  # fmt: skip
    body = final_body("chat", "chatcmpl-1", "m", [choice])
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "abc"
    assert len(body["choices"][0]["logprobs"]["content"]) == 3


def test_usage_of_n_choices_counts_the_prompt_once():
    total = total_usage([UsageCount(10, 8, 3), UsageCount(10, 8, 4)])
    assert total.to_json()["total_tokens"] == 17 and total.cached_tokens == 8


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' and not loop.first %}"
    "{{ raise_exception('system must come first') }}{% endif %}<|{{ m['role'] }}|>\n{{ m['content'] | trim }}"
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def test_chat_template_renders_as_transformers_does(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hybridserve_cli.init_model import write_random_checkpoint
    from tests.gateway.conftest import SPEC

    model = write_random_checkpoint(tmp_path / "m", SPEC)
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    messages = [{"role": "system", "content": "Be terse. "}, {"role": "user", "content": "  Hi!"},
                {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "Bye ü"}]  # fmt: skip
    oracle = transformers.AutoTokenizer.from_pretrained(str(model)).apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    template = load_chat_template(model)
    assert template is not None
    assert template.render([Message(m["role"], m["content"]) for m in messages]) == oracle
    with pytest.raises(ApiError) as exc:
        template.render([Message("user", "x"), Message("system", "late")])
    assert exc.value.status == 400 and "system must come first" in exc.value.message


def test_no_template_is_none(tmp_path):
    assert load_chat_template(tmp_path) is None
    compiled = ChatTemplate.compile("{{ messages | tojson }}", {})
    assert compiled.render([Message("user", "é")]) == '[{"role": "user", "content": "é"}]'


def test_api_keys(tmp_path):
    key_file = tmp_path / "keys"
    key_file.write_text("# keys\nalpha\n\n beta  # the second\n")
    keys = load_keys(key_file, "ignored")
    assert keys == {"alpha", "beta"} and load_keys(None, "x, y,") == {"x", "y"} and load_keys(None, None) == set()
    assert bearer_token("Bearer alpha") == "alpha" and bearer_token("bearer  beta ") == "beta"
    assert bearer_token("Basic alpha") is None and bearer_token("") is None
    assert is_authorized(keys, "Bearer beta") and not is_authorized(keys, "Bearer gamma")
    assert not is_authorized(keys, None) and is_authorized(frozenset(), None)


def test_token_id_prompts_must_fit_the_wire():
    for bad in ([-1], [2**31], [3, 2**40]):
        assert rejected(parse_completion, {"model": "m", "prompt": bad}).param == "prompt"
