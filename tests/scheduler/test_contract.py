"""The Scheduler service's contract over a real channel: determinism, bad input, fuzzing, load."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridserve.v1 import scheduler_pb2 as pb
from scheduler_svc import convert
from tests.scheduler.helpers import SEED_CONFIG, config, decode, prefill, seed_step, step

PLAN_STEP = "/hybridserve.v1.Scheduler/PlanStep"


def raw_call(channel: grpc.Channel, payload: bytes) -> bytes:
    """PlanStep with the request and response as bytes, to compare them exactly."""
    call = channel.unary_unary(PLAN_STEP, request_serializer=None, response_deserializer=None)
    return call(payload, timeout=5)


def seed_bytes() -> bytes:
    return convert.step_to_pb(seed_step(3)).SerializeToString(deterministic=True)


def test_same_request_bytes_give_same_response_bytes(channel):
    payload = seed_bytes()
    answers = {raw_call(channel, payload) for _ in range(20)}
    assert len(answers) == 1


def _bad_inputs() -> dict[str, pb.PlanStepRequest]:
    good = convert.step_to_pb(seed_step())
    cases: dict[str, pb.PlanStepRequest] = {}

    def variant(name: str, **config_fields: int) -> None:
        msg = pb.PlanStepRequest()
        msg.CopyFrom(good)
        for key, value in config_fields.items():
            setattr(msg.config, key, value)
        cases[name] = msg

    variant("zero batched budget", max_num_batched_tokens=0)
    variant("negative batched budget", max_num_batched_tokens=-5)
    variant("zero max_num_seqs", max_num_seqs=0)
    variant("negative micro budget", max_num_prefill_tokens_per_step=-2048)
    variant("negative threshold", long_prefill_token_threshold=-1)
    variant("block not a multiple of mamba block", block_size=2000)
    variant("page does not divide block", kv_page_size=24)
    variant("zero page", kv_page_size=0)
    variant("zero mamba block in ALIGN", mamba_block_size=0)
    variant("unknown cache mode", mamba_cache_mode=7)
    variant("micro budget off the quantum", max_num_prefill_tokens_per_step=2304)
    no_config = pb.PlanStepRequest()
    no_config.CopyFrom(good)
    no_config.ClearField("config")
    cases["absent config"] = no_config
    dup = pb.PlanStepRequest()
    dup.CopyFrom(good)
    dup.waiting.append(convert.state_to_pb(prefill("p0", 100)))
    cases["duplicate request id"] = dup
    beyond = convert.step_to_pb(step(SEED_CONFIG, [prefill("x", 100)]))
    beyond.running[0].num_computed_tokens = 150
    cases["computed beyond the known tokens"] = beyond
    empty_id = convert.step_to_pb(step(SEED_CONFIG, [prefill("x", 100)]))
    empty_id.running[0].request_id = ""
    cases["empty request id"] = empty_id
    too_many = convert.step_to_pb(step(config(max_num_seqs=2), [decode(f"d{i}") for i in range(3)]))
    cases["more running than max_num_seqs"] = too_many
    negative_pages = convert.step_to_pb(seed_step())
    negative_pages.num_free_kv_pages = -1
    cases["negative free pages"] = negative_pages
    return cases


@pytest.mark.parametrize("name", list(_bad_inputs()))
def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(stub, name):
    with pytest.raises(grpc.RpcError) as err:
        stub.PlanStep(_bad_inputs()[name], timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert err.value.details(), "the message must say what to fix"
    assert stub.PlanStep(convert.step_to_pb(seed_step()), timeout=5).quantum == 2048


def test_oversized_message_gets_the_standard_size_error(stub):
    huge = convert.step_to_pb(seed_step())
    for i in range(90_000):
        huge.waiting.append(pb.RequestState(request_id=f"w{i:08d}-{'x' * 40}", num_prompt_tokens=10, max_tokens=1))
    assert huge.ByteSize() > 4 * 1024 * 1024
    with pytest.raises(grpc.RpcError) as err:
        stub.PlanStep(huge, timeout=10)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert stub.PlanStep(convert.step_to_pb(seed_step()), timeout=5).quantum == 2048


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.one_of(st.binary(max_size=512), st.builds(lambda b: seed_bytes()[: len(b)] + b, st.binary(max_size=64))))
def test_fuzzed_raw_bytes_get_ok_or_invalid_argument(channel, payload):
    try:
        raw_call(channel, payload)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    st.lists(st.integers(-(2**40), 2**40), min_size=8, max_size=8),
    st.lists(st.tuples(st.text(max_size=4), *[st.integers(-5, 5000)] * 4), max_size=6),
)
def test_fuzzed_field_values_get_ok_or_invalid_argument(stub, config_values, requests):
    fields = [f.name for f in pb.SchedulerConfig.DESCRIPTOR.fields if f.name != "mamba_cache_mode"]
    msg = pb.PlanStepRequest(config=pb.SchedulerConfig(**dict(zip(fields, config_values, strict=False))))
    msg.config.mamba_cache_mode = abs(config_values[7]) % 3
    for rid, prompt, computed, output, max_tokens in requests:
        msg.running.add(
            request_id=rid,
            num_prompt_tokens=prompt,
            num_computed_tokens=computed,
            num_output_tokens=output,
            max_tokens=max_tokens,
        )
    try:
        stub.PlanStep(msg, timeout=5)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())


def test_64_concurrent_callers_for_a_bounded_time_see_zero_errors(stub):
    payloads = [convert.step_to_pb(seed_step(i)) for i in range(8)]
    errors: list[BaseException] = []
    counts = [0] * 64
    deadline = time.monotonic() + 3.0

    def caller(index: int) -> None:
        while time.monotonic() < deadline:
            try:
                resp = stub.PlanStep(payloads[(index + counts[index]) % 8], timeout=10)
                assert resp.stats.num_prefill_tokens == 4096
                counts[index] += 1
            except BaseException as exc:  # collected and asserted below
                errors.append(exc)
                return

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(64)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    assert not errors, errors[:3]
    assert all(c > 0 for c in counts), "every caller got answers"
