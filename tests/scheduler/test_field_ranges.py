"""PlanStep fields the wire allows and the planner cannot order or trust: non-finite arrival times,
a waiting request that claims computed tokens beyond its prompt, int64 extremes. Each is
INVALID_ARGUMENT over a real channel with a message that names the field and what to send."""

from __future__ import annotations

import math

import grpc
import pytest

from hybridserve.v1 import scheduler_pb2 as pb
from scheduler_svc import convert
from tests.scheduler.helpers import SEED_CONFIG, decode, prefill, seed_step, step

INT64_MAX = 2**63 - 1


def plan_error(stub, msg: pb.PlanStepRequest) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as err:
        stub.PlanStep(msg, timeout=5)
    return err.value


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("queue", ["running", "waiting"])
def test_a_non_finite_arrival_time_is_invalid_argument_naming_it(stub, value, queue):
    request = convert.state_to_pb(prefill("x", 100))
    request.arrival_time = value
    msg = convert.step_to_pb(step(SEED_CONFIG))
    getattr(msg, queue).append(request)
    err = plan_error(stub, msg)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"{queue}[0]" in err.details() and "arrival_time" in err.details() and "finite" in err.details()
    assert stub.PlanStep(convert.step_to_pb(seed_step()), timeout=5).quantum == 2048


@pytest.mark.parametrize("computed", [100, 101, 150, INT64_MAX])
def test_a_waiting_request_at_or_past_its_prompt_is_told_about_waiting_not_decodes(stub, computed):
    msg = convert.step_to_pb(step(SEED_CONFIG, waiting=[prefill("w", 100)]))
    msg.waiting[0].num_computed_tokens = computed
    err = plan_error(stub, msg)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = err.details()
    assert "waiting[0]" in details and "waiting request" in details, details
    assert f"num_computed_tokens = {computed} must be < num_prompt_tokens = 100" in details, details
    assert "decode" not in details, details


def test_a_waiting_request_with_outputs_is_told_to_fold_them_into_the_prompt(stub):
    msg = convert.step_to_pb(step(SEED_CONFIG, waiting=[prefill("w", 100)]))
    msg.waiting[0].num_output_tokens = 3
    err = plan_error(stub, msg)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_output_tokens = 3 in a waiting request; it must be 0" in err.details(), err.details()


def test_a_running_decode_past_its_tokens_still_gets_the_decode_message(stub):
    msg = convert.step_to_pb(step(SEED_CONFIG, [decode("d", prompt=100, output=2)]))
    msg.running[0].num_computed_tokens = 150
    err = plan_error(stub, msg)
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "must equal num_prompt_tokens + num_output_tokens - 1 = 101" in err.details(), err.details()


@pytest.mark.parametrize(
    "field", ["max_num_batched_tokens", "max_num_seqs", "block_size", "kv_page_size", "mamba_block_size"]
)
@pytest.mark.parametrize("value", [INT64_MAX, -(2**63)])
def test_int64_extremes_in_the_config_are_served_or_invalid_argument(stub, field, value):
    msg = convert.step_to_pb(seed_step())
    setattr(msg.config, field, value)
    try:
        plan = stub.PlanStep(msg, timeout=5)
    except grpc.RpcError as err:
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, (err.code(), err.details())
        assert f"config.{field}" in err.details() or "config." in err.details(), err.details()
    else:
        assert sum(s.num_tokens for s in plan.slices) <= msg.config.max_num_batched_tokens
    assert stub.PlanStep(convert.step_to_pb(seed_step()), timeout=5).quantum == 2048
