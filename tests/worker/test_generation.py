"""Generation over gRPC against transformers as the oracle: greedy equality, concurrency,
preemption, aborts and cancellation."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from hybridserve.v1 import generation_pb2 as pb
from tests.worker.conftest import collect, greedy_request, hf_greedy, prompt_of

PROMPT_LENGTHS = [1, 7, 16, 33, 50]


@pytest.fixture(scope="module")
def oracle(hf_model):
    """Greedy continuations from transformers generate(), computed once per (length, seed, n)."""
    cache: dict[tuple[int, int, int], list[int]] = {}

    def get(length: int, seed: int, max_tokens: int) -> list[int]:
        key = (length, seed, max_tokens)
        if key not in cache:
            cache[key] = hf_greedy(hf_model, prompt_of(length, seed), max_tokens)
        return cache[key]

    return get


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_greedy_output_equals_transformers_generate(start_worker, oracle, async_scheduling):
    worker = start_worker(async_scheduling=async_scheduling)
    for length in PROMPT_LENGTHS:
        tokens, messages = collect(worker.stub.Generate(greedy_request(prompt_of(length, 1), 24), timeout=60))
        assert tokens == oracle(length, 1, 24), f"prompt length {length}"
        last = messages[-1]
        assert last.finish_reason == pb.FINISH_REASON_LENGTH
        assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (length, 24)
        assert all(len(m.logprobs) == len(m.token_ids) for m in messages)
        assert all(lp <= 0 for m in messages for lp in m.logprobs)


@pytest.mark.slow
def test_32_concurrent_streaming_clients_all_complete_correctly(start_worker, oracle):
    worker = start_worker()
    jobs = [(3 + (i * 7) % 60, 100 + i, 8 + i % 9) for i in range(32)]
    expected = {i: oracle(*job) for i, job in enumerate(jobs)}
    results: dict[int, list[int]] = {}
    errors: list[BaseException] = []

    def client(i: int) -> None:
        length, seed, max_tokens = jobs[i]
        try:
            results[i], _ = collect(
                worker.stub.Generate(greedy_request(prompt_of(length, seed), max_tokens), timeout=120)
            )
        except BaseException as exc:  # collected and asserted below
            errors.append(exc)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors[:3]
    assert results == expected
    info = worker.info()
    assert info.num_kv_pages_free == info.num_kv_pages_total
    assert info.num_state_slots_free == info.num_state_slots_total


def test_preemption_under_a_small_kv_budget_keeps_greedy_outputs(start_worker, oracle):
    worker = start_worker(num_kv_pages=40)  # 160 tokens of KV for 6 requests of up to ~80 tokens
    jobs = [(30 + 5 * i, 200 + i, 40) for i in range(6)]
    results: dict[int, list[int]] = {}

    def client(i: int) -> None:
        length, seed, max_tokens = jobs[i]
        results[i], _ = collect(worker.stub.Generate(greedy_request(prompt_of(length, seed), max_tokens), timeout=120))

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert results == {i: oracle(*job) for i, job in enumerate(jobs)}
    info = worker.info()
    assert info.num_preemptions > 0, "the budget was meant to force preemption"
    assert info.num_kv_pages_free == info.num_kv_pages_total == 40


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)


def test_abort_frees_pages_and_slots(start_worker):
    worker = start_worker()
    request = greedy_request(prompt_of(40, 3), 5000)
    request.request_id = "to-abort"
    stream = worker.stub.Generate(request, timeout=60)
    first = next(stream)
    assert first.request_id == "to-abort"
    busy = worker.info()
    assert busy.num_running == 1 and busy.num_kv_pages_free < busy.num_kv_pages_total
    worker.stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=5)
    rest = list(stream)
    assert rest[-1].finish_reason == pb.FINISH_REASON_ABORT
    info = worker.info()
    assert info.num_kv_pages_free == info.num_kv_pages_total
    assert info.num_state_slots_free == info.num_state_slots_total
    with pytest.raises(grpc.RpcError) as err:
        worker.stub.Abort(pb.AbortRequest(request_id="to-abort"), timeout=5)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND


def test_client_cancellation_frees_pages_and_slots(start_worker):
    worker = start_worker()
    stream = worker.stub.Generate(greedy_request(prompt_of(40, 4), 5000), timeout=60)
    next(stream)
    assert worker.info().num_running == 1
    stream.cancel()
    wait_until(lambda: worker.info().num_running == 0)
    info = worker.info()
    assert info.num_kv_pages_free == info.num_kv_pages_total
    assert info.num_state_slots_free == info.num_state_slots_total


def test_seeded_sampling_is_reproducible_whatever_the_batch_mates(start_worker):
    worker = start_worker()
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=prompt_of(12, 9)),
        sampling=pb.SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=30, seed=1234, ignore_eos=True),
    )
    alone, _ = collect(worker.stub.Generate(request, timeout=60))
    others = [worker.stub.Generate(greedy_request(prompt_of(20 + i, i), 30), timeout=60) for i in range(3)]
    together, _ = collect(worker.stub.Generate(request, timeout=60))
    for other in others:
        list(other)
    assert alone == together
    different = pb.GenerateRequest()
    different.CopyFrom(request)
    different.sampling.seed = 4321
    assert collect(worker.stub.Generate(different, timeout=60))[0] != alone
