"""Routing across two real workers: prefix affinity, load spreading, disconnects, a worker killed
with SIGKILL mid-run and brought back."""

from __future__ import annotations

import re
import signal
import threading
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import openai
import pytest

from hybridserve.children import free_port
from hybridserve.v1 import generation_pb2 as pb
from hybridserve.v1 import generation_pb2_grpc as pb_grpc
from tests.gateway.conftest import (
    MODEL_NAME,
    Stack,
    gateway_stack,
    generated_tokens,
    start_gateway,
    start_worker,
    wait_ready,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def routed(model_dir, scheduler) -> Iterator[Stack]:
    with gateway_stack(model_dir, scheduler) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(routed) -> openai.OpenAI:
    return openai.OpenAI(base_url=routed.base_url, api_key="unused", max_retries=0, timeout=120)


def complete(client: openai.OpenAI, prompt: str, max_tokens: int) -> openai.types.Completion:
    return client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip


def tokens_by_worker(stack: Stack) -> list[int]:
    return [generated_tokens(a) for a in stack.worker_addresses]


def metric(stack: Stack, name: str) -> float:
    text = urllib.request.urlopen(f"http://{stack.gateway.address}/metrics", timeout=10).read().decode()
    return sum(float(v) for v in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def test_shared_prefix_lands_on_the_worker_that_cached_it(routed, client):
    system = "System: you are the routing test's assistant; answer briefly and kindly. "  # 74 bytes: 4 blocks
    before = tokens_by_worker(routed)
    results = [complete(client, f"{system}Question {i}?", 4) for i in range(6)]
    deltas = [a - b for a, b in zip(tokens_by_worker(routed), before, strict=True)]
    assert sorted(deltas) == [0, 24], deltas  # every request on one worker
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in results]
    assert cached[0] == 0 and all(c >= 64 for c in cached[1:]), cached


def test_unrelated_load_spreads_over_both_workers(routed, client):
    before = tokens_by_worker(routed)
    prompts = [f"{i}: an unrelated prompt about topic number {i * 7919}" for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda p: complete(client, p, 16), prompts))
    deltas = [a - b for a, b in zip(tokens_by_worker(routed), before, strict=True)]
    assert all(r.choices[0].finish_reason == "length" for r in results)
    assert sum(deltas) == 8 * 16 and min(deltas) > 0, deltas


def test_client_disconnect_aborts_on_the_worker(routed, client):
    before = sum(tokens_by_worker(routed))
    stream = client.completions.create(model=MODEL_NAME, prompt="Disconnect me", max_tokens=5000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    for i, _chunk in enumerate(stream):
        if i == 2:
            break
    stream.close()
    deadline = time.monotonic() + 30
    while sum(tokens_by_worker(routed)) - before > 0 and time.monotonic() < deadline:
        settled = sum(tokens_by_worker(routed))
        time.sleep(0.5)
        if sum(tokens_by_worker(routed)) == settled:
            break
    generated = sum(tokens_by_worker(routed)) - before
    assert generated < 1000, f"the worker kept generating after the client left ({generated} tokens)"


class StreamWatch:
    """One streaming request in a thread: chunks seen, and how it ended."""

    def __init__(self, client: openai.OpenAI, prompt: str, max_tokens: int) -> None:
        self.chunks = 0
        self.error: Exception | None = None
        self.finish_reason: str | None = None
        self.text = ""
        self._thread = threading.Thread(target=self._run, args=(client, prompt, max_tokens), daemon=True)
        self._thread.start()

    def _run(self, client: openai.OpenAI, prompt: str, max_tokens: int) -> None:
        try:
            stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                               stream=True, extra_body={"ignore_eos": True})  # fmt: skip
            for chunk in stream:
                self.chunks += 1
                self.text += chunk.choices[0].text
                self.finish_reason = chunk.choices[0].finish_reason or self.finish_reason
        except Exception as exc:
            self.error = exc

    def join(self) -> None:
        self._thread.join(120)


def test_kill_9_a_worker_mid_run_then_it_comes_back(routed, client, model_dir):
    victim = routed.workers[0]
    # 8 streams over two workers of 2 sequences each: 2 running and 2 waiting on each worker
    watches = [StreamWatch(client, f"Request {i} of the kill test, number {i * 104729}.", 200) for i in range(8)]
    deadline = time.monotonic() + 60
    while sum(w.chunks > 0 for w in watches) < 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    started = [w.chunks > 0 for w in watches]
    assert sum(started) == 4, started  # the running ones; the waiting ones have not produced a token yet
    retries_before = metric(routed, "hybridserve_gateway_retries_total")
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(30)
    for watch in watches:
        watch.join()

    failed = [w for w in watches if w.error is not None]
    assert 1 <= len(failed) <= 2, [(w.chunks, w.error) for w in watches]  # the victim's running requests
    for watch in failed:
        assert watch.chunks > 0 and "failed during generation" in str(watch.error)
        assert isinstance(watch.error, openai.APIError)
    for watch, had_started in zip(watches, started, strict=True):
        if not had_started:  # waiting on the victim or the survivor: finished, the failure unseen
            assert watch.error is None and watch.finish_reason == "length", watch.error
    assert metric(routed, "hybridserve_gateway_retries_total") > retries_before  # the victim's waiting requests
    ready = wait_ready(routed.gateway, 1)
    assert ready[routed.worker_addresses[0]] is False

    # While it is down, everything goes to the survivor; then it comes back at its address.
    assert complete(client, "While one worker is down", 4).choices[0].finish_reason == "length"
    port = routed.worker_addresses[0].rsplit(":", 1)[1]
    routed.workers[0] = start_worker(model_dir, routed.scheduler.address, int(port))
    wait_ready(routed.gateway, 2)
    before = tokens_by_worker(routed)
    with ThreadPoolExecutor(6) as pool:
        list(pool.map(lambda i: complete(client, f"After the restart, prompt {i} {i * 31337}", 12), range(6)))
    deltas = [a - b for a, b in zip(tokens_by_worker(routed), before, strict=True)]
    assert min(deltas) > 0, deltas


def test_a_full_queue_everywhere_is_a_429(model_dir, scheduler):
    worker = start_worker(model_dir, scheduler.address, free_port(), "--max-num-seqs", "1", "--max-queue-len", "1")
    gateway = start_gateway([worker.address], model_dir)
    try:
        wait_ready(gateway, 1)
        client = openai.OpenAI(base_url=f"http://{gateway.address}/v1", api_key="unused", max_retries=0, timeout=120)
        running = StreamWatch(client, "The one running request", 400)
        while running.chunks == 0 and running.error is None:
            time.sleep(0.02)
        waiting = StreamWatch(client, "The one waiting request", 4)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with grpc.insecure_channel(worker.address) as channel:
                info = pb_grpc.GenerationStub(channel).GetInfo(pb.GetInfoRequest(), timeout=10)
            if info.num_waiting == 1:
                break
            time.sleep(0.02)
        with pytest.raises(openai.RateLimitError) as exc:
            complete(client, "One too many", 4)
        assert exc.value.status_code == 429 and "queue is full" in exc.value.message
        assert exc.value.body["code"] == "queue_full"
        running.join()
        waiting.join()
        assert running.error is None and waiting.error is None and waiting.finish_reason == "length"
    finally:
        gateway.stop()
        worker.stop()
