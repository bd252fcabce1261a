"""A gateway started without --model takes the tokenizer, chat template and generation defaults from its
workers (GetModelFiles), here a 100k-entry tokenizer.json over 4 MiB (beyond gRPC's default message
size), and keeps workers serving other files out of rotation."""

from __future__ import annotations

import asyncio
import json
import shutil
import time
import urllib.request
from pathlib import Path

import grpc
import openai
import pytest

from gateway.http_app import Gateway
from gateway.model_files import fetch_model_files
from hybridserve.model_files import read_model_files
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from tests.gateway.conftest import MODEL_NAME, start_worker, wait_ready
from tests.procs import ServerProcess

pytestmark = pytest.mark.slow

NUM_PADDING_TOKENS = 100_000


@pytest.fixture(scope="module")
def large_vocab_dir(model_dir, tmp_path_factory) -> Path:
    """The test model with 100k more vocabulary entries no merge reaches (so its outputs are the same),
    which make tokenizer.json several MB, as a real 100k vocabulary's is."""
    root = tmp_path_factory.mktemp("large-vocab") / "tiny"
    shutil.copytree(model_dir, root)
    tokenizer = json.loads((root / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    first = max(vocab.values()) + 1
    vocab.update({f"<|unused_{i:06d}_padding_entry_of_a_large_vocab|>": first + i for i in range(NUM_PADDING_TOKENS)})
    (root / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert (root / "tokenizer.json").stat().st_size > 4 << 20
    return root


@pytest.fixture(scope="module")
def workers(large_vocab_dir, model_dir, scheduler):
    """One worker of the large-vocabulary files, one of the stock test model's (other files)."""
    from hybridserve.children import free_ports

    ports = free_ports(2)
    started = []
    try:
        for folder, port in zip((large_vocab_dir, model_dir), ports, strict=True):
            started.append(start_worker(folder, scheduler.address, port))
        yield [f"127.0.0.1:{p}" for p in ports]
    finally:
        for worker in started:
            worker.stop()


def gateway_without_model(addresses: list[str]) -> ServerProcess:
    return ServerProcess(["gateway", "--workers", ",".join(addresses), "--port", "0", "--grpc-port", "0",
                          "--served-model-name", MODEL_NAME])  # fmt: skip


@pytest.fixture(scope="module")
def gateway(workers):
    proc = gateway_without_model(workers[:1])
    try:
        wait_ready(proc, 1, timeout_s=60)
        yield proc
    finally:
        assert proc.stop() == 0, proc.output


def test_chat_and_completions_with_the_workers_files(gateway, large_vocab_dir):
    client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0, timeout=120)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hello!"}], max_tokens=3, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    rendered = "<|bos|><|user|>Hello!\n<|assistant|>"  # the template came from the worker
    assert chat.usage.prompt_tokens == len(rendered.encode()) - len("<|bos|>") + 1
    completion = client.completions.create(
        model=MODEL_NAME, prompt="Tokenized here", max_tokens=3, temperature=0, logprobs=1,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert completion.choices[0].finish_reason == "length"
    assert not any(t.startswith("token_id:") for t in completion.choices[0].logprobs.tokens)  # the tokenizer came
    size = (large_vocab_dir / "tokenizer.json").stat().st_size
    assert any("model files" in line and f"tokenizer.json ({size} bytes)" in line for line in gateway.lines), (
        gateway.output
    )
    request = urllib.request.Request(f"http://{gateway.address}/tokenize", json.dumps({"prompt": "abc"}).encode())
    with urllib.request.urlopen(request, timeout=30) as response:
        assert json.loads(response.read())["count"] == 3


def test_workers_with_other_files_are_not_routed_to(workers):
    proc = gateway_without_model(workers)
    try:
        wait_ready(proc, 1, timeout_s=60)
        time.sleep(1.0)  # a few polls more: the other worker stays out
        with urllib.request.urlopen(f"http://{proc.address}/ready", timeout=10) as response:
            ready = json.loads(response.read())["workers"]
        assert sorted(ready.values()) == [False, True], ready
        (out,) = [address for address, is_ready in ready.items() if not is_ready]
        assert any(f"worker {out} out of rotation: it serves model files" in line for line in proc.lines), proc.output
    finally:
        assert proc.stop() == 0, proc.output


def test_a_worker_serves_its_files_in_chunks_and_checks_the_hash(workers, large_vocab_dir):
    expected = read_model_files(large_vocab_dir)
    with grpc.insecure_channel(workers[0]) as channel:
        stub = pb_grpc.GenerationStub(channel)
        assert stub.GetInfo(pb.GetInfoRequest(), timeout=30).model_files_hash == expected.hash
        chunks = list(stub.GetModelFiles(pb.GetModelFilesRequest(), timeout=60))
        assert max(len(c.data) for c in chunks) == 1 << 20
        assert {c.name for c in chunks} == set(expected.files) and "model.safetensors" not in expected.files
        with pytest.raises(grpc.RpcError) as wrong:
            list(stub.GetModelFiles(pb.GetModelFilesRequest(model_files_hash="0" * 64), timeout=60))
        assert wrong.value.code() == grpc.StatusCode.FAILED_PRECONDITION

    async def fetch() -> None:
        async with grpc.aio.insecure_channel(workers[0]) as channel:
            got = await fetch_model_files(pb_grpc.GenerationStub(channel), expected.hash)
        assert got == expected

    asyncio.run(fetch())


def test_the_missing_template_error_says_which_is_missing():
    gateway = Gateway(None, None, frozenset(), "", None, None, 1.0, files_source="")  # type: ignore[arg-type]
    assert "no model folder (--model) and no worker has sent" in gateway.missing_template_reason()
    gateway.files_source = "workers"
    assert gateway.missing_template_reason().startswith("this model has no chat template")
    assert "the files the workers sent" in gateway.missing_template_reason()
