"""The official OpenAI client against a real gateway in front of two real workers."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import grpc
import openai
import pytest

from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from tests.gateway.conftest import API_KEY, MODEL_NAME, grpc_address

pytestmark = pytest.mark.slow

AUTH = [("authorization", f"Bearer {API_KEY}")]  # gRPC metadata


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.base_url, api_key=API_KEY, max_retries=0, timeout=120)


def post(stack, path: str, body: bytes, key: str | None = API_KEY) -> tuple[int, dict]:
    """A raw HTTP POST (for bodies the OpenAI client would never send)."""
    headers = {"Content-Type": "application/json"}
    if key is not None:
        headers["Authorization"] = f"Bearer {key}"
    request = urllib.request.Request(f"http://{stack.gateway.address}{path}", data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_models_lists_the_served_model(client):
    assert [m.id for m in client.models.list()] == [MODEL_NAME]


def test_completion_greedy_with_logprobs(client):
    result = client.completions.create(
        model=MODEL_NAME,
        prompt="The gateway routes by prefix.",
        max_tokens=6,
        temperature=0,
        logprobs=3,
        extra_body={"ignore_eos": True},
    )
    choice = result.choices[0]
    assert choice.finish_reason == "length"
    assert result.usage.completion_tokens == 6 and result.usage.prompt_tokens == len("The gateway routes by prefix.")
    assert result.usage.total_tokens == result.usage.prompt_tokens + 6
    assert result.usage.prompt_tokens_details.cached_tokens >= 0
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == len(logprobs.top_logprobs) == 6
    for lp, top in zip(logprobs.token_logprobs, logprobs.top_logprobs, strict=True):
        assert lp <= 0 and 1 <= len(top) <= 3  # token texts key the dict: bytes decoding alike ('\ufffd') merge
        assert lp >= max(top.values()) - 1e-5  # greedy: the chosen token is the best


def test_chat_uses_the_model_template(client, stack):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    result = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_completion_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    rendered = "<|bos|><|system|>Be brief.\n<|user|>Hello!\n<|assistant|>"
    # the byte tokenizer: one token per byte, plus one for the <|bos|> special token
    assert result.usage.prompt_tokens == len(rendered.encode()) - len("<|bos|>") + 1
    choice = result.choices[0]
    assert choice.message.role == "assistant" and choice.finish_reason == "length"
    assert len(choice.logprobs.content) == 4
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    assert "".join(e.token for e in choice.logprobs.content).startswith(choice.message.content[:1])


def test_streaming_chat_with_usage(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Stream"}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert all(c.usage is None for c in chunks[:-1])
    assert [c.choices[0].finish_reason for c in chunks[:-1]][-1] == "length"
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    full = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Stream"}],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert text == full.choices[0].message.content


def test_continuous_usage_stats_put_usage_in_every_chunk(stack):
    """The body GuideLLM 0.8 sends for /v1/completions: stream_options.continuous_usage_stats and stop null."""
    body = {
        "model": MODEL_NAME,
        "prompt": "abcd",
        "max_tokens": 4,
        "stop": None,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    request = urllib.request.Request(
        f"http://{stack.gateway.address}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {API_KEY}"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        events = [line for line in response.read().decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    *token_chunks, last = chunks
    assert last["choices"] == [] and last["usage"]["completion_tokens"] == 4
    prompt_tokens = last["usage"]["prompt_tokens"]
    counts = [c["usage"]["completion_tokens"] for c in token_chunks]
    assert counts == sorted(counts) and counts[-1] == 4 and counts[0] >= 1
    assert all(c["usage"]["prompt_tokens"] == prompt_tokens for c in token_chunks)
    assert all(c["usage"]["total_tokens"] == prompt_tokens + n for c, n in zip(token_chunks, counts, strict=True))


def test_streaming_completion_ends_with_done(stack):
    body = json.dumps({"model": MODEL_NAME, "prompt": "abc", "max_tokens": 3, "stream": True}).encode()
    request = urllib.request.Request(
        f"http://{stack.gateway.address}/v1/completions", data=body, headers={"Authorization": f"Bearer {API_KEY}"}
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        events = [line for line in response.read().decode().split("\n\n") if line]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks) and "usage" not in chunks[-1]


def test_stop_string_ends_the_choice(client):
    free = client.completions.create(
        model=MODEL_NAME, prompt="Stop here:", max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
    )
    text = free.choices[0].text
    pairs = (text[i : i + 2] for i in range(3, len(text) - 1))
    stop = next((p for p in pairs if p.isprintable() and p.strip()), None)
    if stop is None:
        pytest.skip(f"the random model's output {text!r} holds no printable pair to stop at")
    stopped = client.completions.create(
        model=MODEL_NAME,
        prompt="Stop here:",
        max_tokens=12,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.choices[0].text == text[: text.index(stop)]


def test_n_choices_and_seed(client):
    kwargs = dict(
        model=MODEL_NAME,
        prompt="Sample me",
        max_tokens=8,
        temperature=1.0,
        seed=11,
        n=3,
        extra_body={"ignore_eos": True},
    )
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]  # seeded: repeatable
    assert len({c.text for c in first.choices}) > 1  # seed + i per choice: they differ
    assert first.usage.completion_tokens == 24


def test_greedy_output_equals_the_workers_grpc_output(client, stack):
    prompt = "Greedy parity between the gateway and the worker."
    with grpc.insecure_channel(stack.worker_addresses[0]) as channel:
        request = pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(max_tokens=10, ignore_eos=True))
        direct = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60))
    direct_ids = [t for m in direct for t in m.token_ids]
    direct_text = "".join(m.text for m in direct)
    http = client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=10, temperature=0, extra_body={"ignore_eos": True}
    )
    assert http.choices[0].text == direct_text
    with grpc.insecure_channel(grpc_address(stack.gateway)) as channel:
        proxied = list(pb_grpc.GenerationStub(channel).Generate(request, timeout=60, metadata=AUTH))
    assert [t for m in proxied for t in m.token_ids] == direct_ids


def test_grpc_proxy_requires_the_key_and_keeps_worker_status(stack):
    with grpc.insecure_channel(grpc_address(stack.gateway)) as channel:
        stub = pb_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as missing:
            list(stub.Generate(pb.GenerateRequest(prompt="x"), timeout=30))
        assert missing.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as empty:
            list(stub.Generate(pb.GenerateRequest(prompt=""), timeout=30, metadata=AUTH))
        assert empty.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "empty" in empty.value.details()
        info = stub.GetInfo(pb.GetInfoRequest(), timeout=30, metadata=AUTH)
        assert info.block_size == 16


def _error(body: dict) -> dict:
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    return body["error"]


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b"[1, 2]", 400, None),
        (json.dumps({"model": MODEL_NAME, "prompt": "x", "max_tokens": "ten"}).encode(), 400, "max_tokens"),
        (json.dumps({"model": MODEL_NAME, "prompt": "x", "temperature": True}).encode(), 400, "temperature"),
        (json.dumps({"model": MODEL_NAME, "prompt": 42}).encode(), 400, "prompt"),
        (json.dumps({"model": MODEL_NAME, "prompt": "x", "presence_penalty": 2.5}).encode(), 400, "presence_penalty"),
        (json.dumps({"model": MODEL_NAME, "prompt": "x", "no_such_field": 1}).encode(), 400, "no_such_field"),
        (json.dumps({"model": "gpt-4o", "prompt": "x"}).encode(), 404, "model"),
        (json.dumps({"model": MODEL_NAME, "prompt": "x" * 100_000}).encode(), 413, None),
    ],
)
def test_bad_requests_get_openai_errors(stack, body, status, param):
    got_status, got = post(stack, "/v1/completions", body)
    error = _error(got)
    assert got_status == status and error["param"] == param, got
    assert error["type"] == "invalid_request_error" and error["message"]


def test_chat_errors_name_the_field(stack):
    bad_schema = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strnig"}}}
    for field, value, param in (("tools", [{"type": "function"}], "tools[0].function"),
                                ("response_format", bad_schema, "response_format.json_schema.schema")):  # fmt: skip
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "x"}], field: value}
        status, got = post(stack, "/v1/chat/completions", json.dumps(body).encode())
        assert status == 400 and _error(got)["param"] == param and param in got["error"]["message"], got
    status, got = post(stack, "/v1/chat/completions", json.dumps({"model": MODEL_NAME, "messages": "hi"}).encode())
    assert status == 400 and _error(got)["param"] == "messages"


def test_worker_rejection_is_a_400_not_a_500(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1_000_000)
    assert "max_tokens" in exc.value.message


def test_missing_or_wrong_key_is_401_and_health_stays_open(stack):
    for key in (None, "wrong"):
        status, got = post(stack, "/v1/completions", json.dumps({"model": MODEL_NAME, "prompt": "x"}).encode(), key)
        assert status == 401 and _error(got)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=stack.base_url, api_key="wrong", max_retries=0).models.list()
    for path in ("/health", "/ready", "/metrics"):
        with urllib.request.urlopen(f"http://{stack.gateway.address}{path}", timeout=10) as response:
            assert response.status == 200


def test_a_worker_reports_its_memory_split_and_model_length(stack, model_dir):
    """GetInfo from a worker process on CPU, given --memory-budget-mb 24, --max-num-seqs 2 and 64 checkpoints."""
    with grpc.insecure_channel(stack.worker_addresses[0]) as channel:
        info = pb_grpc.GenerationStub(channel).GetInfo(pb.GetInfoRequest(), timeout=30)
    assert (info.memory_budget_bytes, info.memory_source) == (24 << 20, "--memory-budget-mb")
    assert info.device_memory_bytes == 0  # CPU
    assert info.kv_pool_bytes == info.num_kv_pages_total * info.kv_page_size * info.kv_bytes_per_token > 0
    assert info.state_pool_bytes == 2 * info.state_bytes_per_request > 0
    assert info.num_checkpoint_slots == 64 and info.checkpoint_pool_bytes == 64 * info.state_bytes_per_request
    spare = info.memory_budget_bytes - info.kv_pool_bytes - info.state_pool_bytes - info.checkpoint_pool_bytes
    assert 0 <= spare < info.kv_page_size * info.kv_bytes_per_token
    assert info.weights_bytes > 0 and info.activation_budget_bytes > 0
    positions = json.loads((model_dir / "config.json").read_text())["max_position_embeddings"]
    pool_tokens = info.num_kv_pages_total * info.kv_page_size
    assert info.max_model_len == min(positions, pool_tokens)
    expected = "max_position_embeddings" if positions <= pool_tokens else "the KV pool"
    assert info.max_model_len_source.startswith(expected), info.max_model_len_source
