"""What a worker refuses, and how: clear INVALID_ARGUMENT messages, RESOURCE_EXHAUSTED for a full
queue, UNAVAILABLE when no scheduler answers, DEADLINE_EXCEEDED for a passed deadline."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from dataclasses import replace

import grpc
import pytest

from gpu_worker.engine.admission import max_model_len_limit
from gpu_worker.engine.settings import EngineSettings
from gpu_worker.runner.runner import ModelRunner
from gpu_worker.runner.settings import RunnerConfig
from hybridserve.children import free_port
from hybridserve.errors import InvalidArgumentError
from hybridserve.v1 import generation_pb2 as pb
from tests.worker.conftest import SCHEDULER, collect, greedy_request, prompt_of


def code_and_message(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        list(call())
    return err.value.code(), err.value.details()


BAD = {
    "empty prompt": (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[])), "empty"),
    "no prompt": (pb.GenerateRequest(), "prompt"),
    "token outside vocab": (pb.GenerateRequest(prompt_token_ids=pb.TokenIds(ids=[5, 100000])), "vocabulary"),
    "negative temperature": (greedy_request([5, 6], 4, temperature=-1.0), "temperature"),
    "top_p above 1": (greedy_request([5, 6], 4, top_p=1.5), "top_p"),
    "negative top_k": (greedy_request([5, 6], 4, top_k=-3), "top_k"),
    "too many logprobs": (greedy_request([5, 6], 4, logprobs=500), "logprobs"),
    "negative max_tokens": (greedy_request([5, 6], -1), "max_tokens"),
    "longer than the cache can hold": (greedy_request(prompt_of(50, 1), 10_000_000), "exceeds"),
    "empty stop string": (greedy_request([5, 6], 4, stop=[""]), "stop"),
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_requests_get_invalid_argument_and_the_worker_keeps_serving(start_worker, name):
    worker = start_worker()
    request, phrase = BAD[name]
    code, message = code_and_message(lambda: worker.stub.Generate(request, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert phrase in message, message
    tokens, _ = collect(worker.stub.Generate(greedy_request([5, 6, 7], 3), timeout=30))
    assert len(tokens) == 3


def test_duplicate_live_request_id_is_rejected(start_worker):
    worker = start_worker()
    first = greedy_request(prompt_of(20, 1), 5000)
    first.request_id = "same"
    stream = worker.stub.Generate(first, timeout=30)
    next(stream)
    code, message = code_and_message(lambda: worker.stub.Generate(first, timeout=10))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "already in use" in message
    stream.cancel()


def dead_address() -> str:
    return f"127.0.0.1:{free_port()}"  # free a moment ago: nothing listens there


def test_full_queue_is_resource_exhausted_and_no_scheduler_means_unavailable(start_worker):
    worker = start_worker(scheduler_addresses=(dead_address(),), max_queue_len=2, scheduler_give_up_s=3.0,
                          scheduler_deadline_s=0.3)  # fmt: skip
    outcomes: list[tuple[grpc.StatusCode, str]] = []

    def client() -> None:
        outcomes.append(code_and_message(lambda: worker.stub.Generate(greedy_request([5, 6, 7], 3), timeout=30)))

    threads = [threading.Thread(target=client) for _ in range(2)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 5
    while worker.engine.num_waiting + len(worker.engine.door.inbox) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    code, message = code_and_message(lambda: worker.stub.Generate(greedy_request([5], 3), timeout=10))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queue is full" in message
    started = time.monotonic()
    for t in threads:
        t.join(30)
    assert time.monotonic() - started < 15, "in-flight requests must end, not hang"
    assert [c for c, _ in outcomes] == [grpc.StatusCode.UNAVAILABLE] * 2
    assert all("no scheduler answered" in m for _, m in outcomes)


def test_deadline_is_honoured(start_worker):
    worker = start_worker()
    longest = worker.info().max_model_len - 30
    assert longest > 2000, "long enough to outlast the deadline"
    code, _ = code_and_message(lambda: worker.stub.Generate(greedy_request(prompt_of(30, 2), longest), timeout=0.5))
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 10
    while worker.info().num_running and time.monotonic() < deadline:
        time.sleep(0.05)
    info = worker.info()
    assert info.num_running == 0 and info.num_kv_pages_free == info.num_kv_pages_total


def test_a_max_model_len_above_what_the_pool_holds_is_refused_at_start_up(checkpoint):
    config = RunnerConfig(memory_budget_bytes=1 << 20, kv_page_size_tokens=4, max_num_seqs=8, num_checkpoint_slots=0,
                          device="cpu", dtype="float32")  # fmt: skip
    runner = ModelRunner.from_model_dir(checkpoint, config)
    pool = runner.kv_pool.num_pages * 4
    settings = EngineSettings(scheduler=SCHEDULER, runner=config, scheduler_addresses=("127.0.0.1:1",))
    assert max_model_len_limit(runner, settings).tokens == pool  # the checkpoint's 262144 positions: capped
    with pytest.raises(InvalidArgumentError, match=f"--max-model-len {pool + 1} exceeds the {pool} tokens"):
        max_model_len_limit(runner, replace(settings, max_model_len=pool + 1))
    runner.close()
    worker = subprocess.run(
        [sys.executable, "-m", "hybridserve_cli", "worker", "--model", str(checkpoint), "--device", "cpu",
         "--memory-budget-mb", "1", "--num-checkpoint-slots", "0", "--max-model-len", "100000000",
         "--scheduler", "127.0.0.1:1", "--port", "0", "--model-process", "off", "--decode-compile", "off"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert worker.returncode != 0 and "Traceback" not in worker.stderr, worker.stderr
    last = worker.stderr.strip().splitlines()[-1]
    assert last.startswith("worker: --max-model-len 100000000 exceeds the") and "KV pool holds" in last, last
