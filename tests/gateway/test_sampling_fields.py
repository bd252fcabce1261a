"""The sampling controls' parsing (gateway/sampling_fields.py) and the worker request they become, and the
shape of an echoed completion (gateway/echo.py), without processes."""

from __future__ import annotations

import pytest

from gateway.api_errors import ApiError
from gateway.convert import generate_requests
from gateway.echo import Echo
from gateway.openai_request import parse_chat, parse_completion
from gateway.openai_response import ChoiceState
from gateway.tokens import token_id_text
from hybridserve.v1 import generation_pb2 as pb

CHAT = {"model": "m", "messages": [{"role": "user", "content": "x"}]}


def test_controls_travel_to_the_worker_on_both_endpoints():
    fields = {"presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2, "min_p": 0.1,
              "logit_bias": {"5": 10, "7": -100}, "min_tokens": 2, "stop_token_ids": [3, 4]}  # fmt: skip
    for api in (parse_completion({"model": "m", "prompt": "x", **fields}), parse_chat({**CHAT, **fields})):
        s = generate_requests(api, [1, 2])[0].sampling
        assert (s.presence_penalty, s.frequency_penalty, s.min_p, s.min_tokens) == pytest.approx((0.5, -1, 0.1, 2))
        assert s.repetition_penalty == pytest.approx(1.2) and dict(s.logit_bias) == {5: 10.0, 7: -100.0}
        assert list(s.stop_token_ids) == [3, 4] and not s.HasField("prompt_logprobs")
    chat = generate_requests(parse_chat(CHAT), [1])[0].sampling
    assert not chat.HasField("max_tokens") and not chat.HasField("repetition_penalty")  # unset: the defaults


def test_echo_with_zero_tokens_asks_for_the_prompt_alone():
    api = parse_completion({"model": "m", "prompt": "x", "echo": True, "max_tokens": 0, "logprobs": 0})
    s = generate_requests(api, [1, 2])[0].sampling
    assert s.HasField("max_tokens") and s.max_tokens == 0 and s.HasField("prompt_logprobs")
    with pytest.raises(ApiError) as exc:  # without echo, 0 is refused as before
        parse_completion({"model": "m", "prompt": "x", "max_tokens": 0})
    assert exc.value.param == "max_tokens"
    with pytest.raises(ApiError) as exc:
        parse_completion({"model": "m", "prompt": "x", "max_tokens": 2, "min_tokens": 3})
    assert exc.value.param == "min_tokens"
    with pytest.raises(ApiError) as exc:  # chat has no echo
        parse_chat({**CHAT, "echo": True})
    assert exc.value.param == "echo"


def test_an_echoed_choice_starts_with_the_prompt_and_its_logprobs():
    choice = ChoiceState(0, "completion", True, True, token_id_text)
    choice.echo = Echo("ab", (1, 2))
    first = pb.GenerateResponse(token_ids=[3], logprobs=[-0.5], text="c", prompt_logprobs=[-1.5])
    entry = choice.apply(first)
    assert entry["text"] == "abc"
    assert entry["logprobs"]["token_logprobs"] == [None, -1.5, -0.5]
    assert entry["logprobs"]["top_logprobs"][0] is None
    choice.apply(pb.GenerateResponse(token_ids=[4], logprobs=[-0.25], text="d", finish_reason=pb.FINISH_REASON_LENGTH))
    body = choice.final_json()
    assert body["text"] == "abcd"
    assert body["logprobs"]["tokens"] == ["token_id:1", "token_id:2", "token_id:3", "token_id:4"]
    assert body["logprobs"]["token_logprobs"] == [None, -1.5, -0.5, -0.25]
    assert body["logprobs"]["text_offset"][2:] == [2, 2 + len("token_id:3")]  # after the echoed text
