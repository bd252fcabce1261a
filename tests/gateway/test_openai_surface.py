"""The OpenAI surface beyond one prompt per request, through the official client and a real gateway started
without --model (it takes the tokenizer and template from its workers) over two real workers: batched
completions prompts, /tokenize and /detokenize, /version, max_model_len in /v1/models, cache salts, echo
with log-probabilities (lm-eval's loglikelihood), the sampling controls."""

from __future__ import annotations

import json
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest

from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from tests.gateway.conftest import MODEL_NAME, gateway_stack

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def stack(model_dir, scheduler):
    with gateway_stack(model_dir, scheduler, gateway_model=False) as s:
        yield s


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


def call(address: str, path: str, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(f"http://{address}{path}", data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


GREEDY = dict(model=MODEL_NAME, max_tokens=4, temperature=0, extra_body={"ignore_eos": True})


def test_batched_prompts_give_n_choices_each_in_order(client):
    prompts = ["First prompt.", "The second one, longer."]
    singles = [client.completions.create(prompt=p, **GREEDY) for p in prompts]
    batch = client.completions.create(prompt=prompts, n=2, **GREEDY)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    # greedy: prompt i's two choices are its single completion, at i*n and i*n+1
    assert [c.text for c in batch.choices] == [s.choices[0].text for s in singles for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles)
    assert batch.usage.completion_tokens == 4 * 4


def test_batched_token_id_prompts_streamed(client, stack):
    _, first = call(stack.gateway.address, "/tokenize", {"prompt": "Token ids in"})
    _, second = call(stack.gateway.address, "/tokenize", {"prompt": "A batch of ids"})
    batch = [first["tokens"], second["tokens"]]
    whole = client.completions.create(prompt=batch, n=2, **GREEDY)
    text = {i: "" for i in range(4)}
    finished = {}
    usage = None
    for chunk in client.completions.create(prompt=batch, n=2, stream=True, stream_options={"include_usage": True},
                                           **GREEDY):  # fmt: skip
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text[choice.index] += choice.text
            if choice.finish_reason:
                finished[choice.index] = choice.finish_reason
    assert text == {c.index: c.text for c in whole.choices}
    assert finished == {i: "length" for i in range(4)}
    assert usage.prompt_tokens == first["count"] + second["count"] == whole.usage.prompt_tokens
    assert usage.completion_tokens == 16


def test_too_many_choices_name_the_field(client):
    with pytest.raises(openai.BadRequestError) as failed:
        client.completions.create(prompt=["x"] * 9, n=16, **GREEDY)
    assert failed.value.body["param"] == "n"
    with pytest.raises(openai.BadRequestError) as failed:
        client.completions.create(prompt=["x", [1, 2]], **GREEDY)
    assert failed.value.body["param"] == "prompt"


def test_tokenize_detokenize_round_trip(stack):
    address = stack.gateway.address
    status, out = call(address, "/tokenize", {"model": MODEL_NAME, "prompt": "Round trip, é!"})
    assert status == 200 and set(out) == {"count", "max_model_len", "tokens", "token_strs"}
    assert out["count"] == len(out["tokens"]) and out["max_model_len"] > 0 and out["token_strs"] is None
    status, back = call(address, "/detokenize", {"model": MODEL_NAME, "tokens": out["tokens"]})
    assert (status, back) == (200, {"prompt": "Round trip, é!"})
    assert out["count"] == len("Round trip, é!".encode())  # the byte tokenizer, which adds no BOS
    messages = [{"role": "user", "content": "Hi"}]
    _, chat = call(address, "/tokenize", {"messages": messages, "return_token_strs": True})
    _, bare = call(address, "/tokenize", {"messages": messages, "add_generation_prompt": False})
    assert "".join(chat["token_strs"]).endswith("<|assistant|>") and chat["count"] > bare["count"]
    status, error = call(address, "/detokenize", {"tokens": [1 << 30]})
    assert status == 400 and error["error"]["param"] == "tokens"


def test_version_and_max_model_len(stack, client):
    status, body = call(stack.gateway.address, "/version")
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    assert (status, body) == (200, {"version": pyproject["project"]["version"]})
    _, models = call(stack.gateway.address, "/v1/models")
    _, tokenized = call(stack.gateway.address, "/tokenize", {"prompt": "x"})
    assert models["data"][0]["max_model_len"] == tokenized["max_model_len"] > 0
    assert client.models.retrieve(MODEL_NAME).model_extra["max_model_len"] == tokenized["max_model_len"]


def test_two_salts_share_no_hits_and_one_salt_does(client):
    prefix = "A system prompt long enough to fill a few cache blocks of sixteen tokens each. "

    def cached_tokens(suffix: str, salt: str, chat: bool = False) -> int:
        extra = {**GREEDY["extra_body"], "cache_salt": salt}
        if chat:
            messages = [{"role": "system", "content": prefix}, {"role": "user", "content": suffix}]
            result = client.chat.completions.create(**{**GREEDY, "extra_body": extra}, messages=messages)
        else:
            result = client.completions.create(**{**GREEDY, "extra_body": extra}, prompt=prefix + suffix)
        return result.usage.prompt_tokens_details.cached_tokens

    assert cached_tokens("one", "tenant-a") == 0
    assert cached_tokens("two", "tenant-b") == 0
    assert cached_tokens("three", "tenant-a") >= 3 * 16
    assert cached_tokens("one", "tenant-c", chat=True) == 0
    assert cached_tokens("two", "tenant-c", chat=True) >= 3 * 16
    with pytest.raises(openai.BadRequestError) as failed:
        client.completions.create(prompt="x", **{**GREEDY, "extra_body": {"cache_salt": "s" * 257}})
    assert failed.value.body["param"] == "cache_salt"


def _worker_greedy(stack, prompt: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    with grpc.insecure_channel(stack.worker_addresses[0]) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(
            prompt_token_ids=pb.TokenIds(ids=prompt),
            sampling=pb.SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True),
        )
        messages = list(stub.Generate(request, timeout=60))
    return [t for m in messages for t in m.token_ids], [lp for m in messages for lp in m.logprobs]


def test_echo_with_logprobs_and_no_new_tokens_scores_the_prompt(client, stack):
    """lm-eval's loglikelihood request: the prompt's tokens and their log-probabilities, the first null; a
    continuation's log-probabilities equal those it was generated with."""
    prompt = [1, 72, 101, 108, 108, 111, 32, 119]
    generated, logprobs = _worker_greedy(stack, prompt, 4)
    scored = client.completions.create(
        model=MODEL_NAME, prompt=prompt + generated, max_tokens=0, echo=True, logprobs=0, temperature=0
    )
    choice = scored.choices[0]
    assert choice.finish_reason == "length" and scored.usage.completion_tokens == 0
    lp = choice.logprobs
    assert len(lp.tokens) == len(prompt) + 4 and lp.token_logprobs[0] is None
    assert all(x <= 0 for x in lp.token_logprobs[1:])
    assert lp.token_logprobs[-4:] == pytest.approx(logprobs, abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset)
    # with new tokens: the prompt's text first, then the completion's; streamed the same
    body = {"model": MODEL_NAME, "prompt": "Hello w", "max_tokens": 3, "echo": True, "logprobs": 1, "temperature": 0}
    whole = client.completions.create(**body)
    assert whole.choices[0].text.startswith("Hello w") and len(whole.choices[0].logprobs.tokens) > 3
    assert whole.choices[0].logprobs.token_logprobs[0] is None
    chunks = list(client.completions.create(**body, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    two = client.completions.create(**{**body, "n": 2})
    assert [c.text for c in two.choices] == [whole.choices[0].text] * 2
    # several prompts: each choice echoes its own (prompt i's choices are i*n .. i*n+n-1)
    other = client.completions.create(**{**body, "prompt": "Abc"})
    batch = client.completions.create(**{**body, "prompt": ["Hello w", "Abc"], "n": 2})
    texts = [c.text for c in sorted(batch.choices, key=lambda c: c.index)]
    assert texts == [whole.choices[0].text] * 2 + [other.choices[0].text] * 2
    assert other.choices[0].text.startswith("Abc")


def test_sampling_controls_reach_the_worker(client, stack):
    prompt = [1, 72, 101, 108, 108, 111]
    plain = _worker_greedy(stack, prompt, 4)[0]
    forced = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, logprobs=0,
        extra_body={"logit_bias": {str(plain[0]): -100, "65": 100}, "min_tokens": 2, "repetition_penalty": 1.1,
                    "presence_penalty": 0.5, "frequency_penalty": 0.5, "min_p": 0.05},
    )  # fmt: skip
    named = client.completions.create(model=MODEL_NAME, prompt=[65], max_tokens=0, echo=True, logprobs=0)
    assert forced.choices[0].logprobs.tokens[0] == named.choices[0].logprobs.tokens[0]  # 65, with +100
    stopped = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=4, temperature=0, extra_body={"stop_token_ids": [plain[1]]}
    )
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == 2
    for field, value in (("logit_bias", {"a": 1}), ("logit_bias", {"5": 200}), ("min_p", 2), ("min_tokens", -1)):
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], field: value}
        status, got = call(stack.gateway.address, "/v1/chat/completions", body)
        assert status == 400 and got["error"]["param"] == field, got
    with pytest.raises(openai.BadRequestError) as exc:  # the worker's check, passed on as a 400
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2, extra_body={"logit_bias": {"9999": 1}})
    assert "logit_bias" in exc.value.message
    assert client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=2).usage.completion_tokens == 2
