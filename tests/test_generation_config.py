"""generation_config.json: EOS ids as an int or a list, and the sampling defaults rule (the request's value,
else the checkpoint's, else the API's), for the Generation API at the worker and the OpenAI API at the gateway."""

from __future__ import annotations

import json

import pytest

from gateway.convert import generate_requests
from gateway.openai_request import parse_chat, parse_completion
from hybridserve.errors import InvalidArgumentError
from hybridserve.generation_config import GenerationDefaults, parse_generation_config, read_generation_config


def test_eos_ids_and_sampling_defaults_are_read(tmp_path):
    assert read_generation_config(tmp_path) == GenerationDefaults()  # no file
    assert read_generation_config(None) == GenerationDefaults()
    raw = {"eos_token_id": [2, 7], "temperature": 0.6, "top_p": 0.9, "top_k": 20, "do_sample": False}
    (tmp_path / "generation_config.json").write_text(json.dumps(raw))
    assert read_generation_config(tmp_path) == GenerationDefaults((2, 7), 0.6, 0.9, 20)
    assert parse_generation_config({"eos_token_id": 5}) == GenerationDefaults((5,))
    assert parse_generation_config({"top_p": 0}).top_p == 1.0  # 0 = off, as on the wire


@pytest.mark.parametrize(
    "raw, key",
    [({"eos_token_id": "x"}, "eos_token_id"), ({"eos_token_id": [1, -2]}, "eos_token_id"),
     ({"temperature": -1}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_k": 2.5}, "top_k"),
     ({"temperature": True}, "temperature")],
)  # fmt: skip
def test_bad_values_name_the_file_and_key(raw, key):
    with pytest.raises(InvalidArgumentError, match=f"cfg/generation_config.json: '{key}'"):
        parse_generation_config(raw, "cfg/generation_config.json")


def test_the_request_wins_then_the_checkpoint_then_the_api():
    defaults = GenerationDefaults(temperature=0.6, top_k=20)  # top_p not named
    assert defaults.sampling(None, None, None, fallback=(0.0, 1.0, 0)) == (0.6, 1.0, 20)
    assert defaults.sampling(0.0, 0.5, 0, fallback=(1.0, 1.0, 0)) == (0.0, 0.5, 0)  # explicit 0s win
    assert GenerationDefaults().sampling(None, None, None, fallback=(1.0, 1.0, 0)) == (1.0, 1.0, 0)


def test_the_gateway_fills_unset_openai_fields_from_the_checkpoint():
    defaults = GenerationDefaults(temperature=0.6, top_p=0.9, top_k=20)
    unset = generate_requests(parse_completion({"model": "m", "prompt": "x"}), "x", defaults)[0].sampling
    assert (round(unset.temperature, 5), round(unset.top_p, 5), unset.top_k) == (0.6, 0.9, 20)
    body = {"model": "m", "prompt": "x", "temperature": 0, "top_p": 1, "top_k": -1}
    explicit = generate_requests(parse_completion(body), "x", defaults)[0].sampling
    assert (explicit.temperature, explicit.top_p, explicit.top_k) == (0.0, 1.0, 0)
    assert explicit.HasField("temperature") and unset.HasField("temperature")  # the gateway always sends them


def test_a_chat_prompt_sent_as_text_asks_for_no_special_tokens():
    chat = parse_chat({"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert generate_requests(chat, "<s>rendered")[0].add_special_tokens is False
    completion = generate_requests(parse_completion({"model": "m", "prompt": "x"}), "x")[0]
    assert not completion.HasField("add_special_tokens")  # unset = the tokenizer's special tokens
