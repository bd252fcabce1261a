"""Bounded input on a real worker process: a huge text prompt is refused by its size before it is
tokenised (findings 3), stop strings are limited (7), non-finite or out-of-range sampling values
are refused with a message that says what to change (9); the worker serves normally after each."""

from __future__ import annotations

import threading

import grpc
import pytest

from hybridserve.v1 import generation_pb2 as pb
from tests.robustness.procs import WorkerClient, text_request, worker

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def served(model_dir, scheduler_process):
    client = worker(model_dir, scheduler_process.address)
    yield client
    client.close()


def refused(client: WorkerClient, request: pb.GenerateRequest, timeout_s: float = 30.0) -> str:
    with pytest.raises(grpc.RpcError) as failed:
        list(client.stub.Generate(request, timeout=timeout_s))
    assert failed.value.code() == grpc.StatusCode.INVALID_ARGUMENT, failed.value.details()
    return failed.value.details()


def served_normally(client: WorkerClient) -> None:
    messages = list(client.stub.Generate(text_request("def main():", 4), timeout=30))
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert sum(len(m.token_ids) for m in messages) == 4


def test_a_40_mb_prompt_is_refused_by_size_before_tokenising_while_small_requests_are_served(served):
    huge = "x" * (40 << 20)
    outcome: list[str] = []
    thread = threading.Thread(target=lambda: outcome.append(refused(served, text_request(huge), timeout_s=20)))
    thread.start()
    for _ in range(3):
        served_normally(served)
    thread.join(30)
    (message,) = outcome
    assert "bytes" in message and "shorten the prompt" in message, message
    limit = served.info().max_model_len
    assert f"at most {limit} tokens" in message


def test_a_prompt_at_the_byte_bound_that_fits_is_still_tokenised_and_judged_by_tokens(served):
    limit = served.info().max_model_len
    message = refused(served, text_request("y" * (limit + 1)))  # fewer bytes than the bound, too many tokens
    assert "tokens" in message and "exceeds" in message, message
    served_normally(served)


@pytest.mark.parametrize(
    ("stop", "says"),
    [
        (["ab"] * 1_000_000, "at most 16"),
        (["s"] * 17, "at most 16"),
        (["z" * 257], "at most 256 are allowed"),
        (["ok", ""], "empty string"),
    ],
    ids=["1M-strings", "17-strings", "257-chars", "empty"],
)
def test_stop_strings_are_limited(served, stop, says):
    assert says in refused(served, text_request("abc", stop=stop))
    served_normally(served)


def test_sixteen_stop_strings_of_256_characters_are_served(served):
    messages = list(served.stub.Generate(text_request("abc", 4, stop=["\x00" * 256] * 16), timeout=30))
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH


@pytest.mark.parametrize(
    ("sampling", "says"),
    [
        ({"temperature": float("inf")}, "sampling.temperature must be a number in [0, 100]"),
        ({"temperature": float("nan")}, "sampling.temperature must be a number in [0, 100]"),
        ({"temperature": -0.5}, "sampling.temperature must be a number in [0, 100]"),
        ({"temperature": 1e9}, "sampling.temperature must be a number in [0, 100]"),
        ({"top_p": float("inf")}, "sampling.top_p must be a number in [0, 1]"),
        ({"top_p": float("-inf")}, "sampling.top_p must be a number in [0, 1]"),
        ({"logprobs": 21}, "sampling.logprobs must be in [0, 20]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"max_tokens": -1}, "max_tokens must be >= 0"),
    ],
    ids=[
        "temp+inf",
        "temp-nan",
        "temp-negative",
        "temp-huge",
        "top_p+inf",
        "top_p-inf",
        "logprobs",
        "top_k",
        "max_tokens",
    ],
)
def test_non_finite_or_out_of_range_sampling_values_are_invalid_argument(served, sampling, says):
    assert says in refused(served, text_request("abc", **{"max_tokens": 4, **sampling}))
    served_normally(served)


def test_token_ids_and_request_ids_are_bounded(served):
    limit = served.info().max_model_len
    ids = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[5] * (limit + 1)), sampling=pb.SamplingParams(max_tokens=1)
    )
    assert f"this worker's limit is {limit}" in refused(served, ids)
    bad_id = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=[5, (1 << 31) - 1]), sampling=pb.SamplingParams(max_tokens=1)
    )
    assert "outside the vocabulary" in refused(served, bad_id)
    long_id = text_request("abc")
    long_id.request_id = "r" * 257
    assert "request_id has 257 characters" in refused(served, long_id)
    served_normally(served)
