"""PlanStep in columns (RequestStateColumns / SliceColumns), the form the worker sends every step: the
same states and the same plan as the message form, on the wire and through a real server; columns of
unequal lengths, or both forms in one request, are INVALID_ARGUMENT."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings

from hybridserve.errors import InvalidArgumentError
from hybridserve.v1 import scheduler_pb2 as pb
from scheduler_svc import convert
from scheduler_svc.core import StepInput, plan_step
from tests.scheduler.helpers import seed_step
from tests.scheduler.strategies import step_inputs


def reparse_request(msg: pb.PlanStepRequest) -> pb.PlanStepRequest:
    return pb.PlanStepRequest.FromString(msg.SerializeToString())


@settings(max_examples=100, deadline=None)
@given(step_inputs())
def test_columns_carry_the_same_step_and_plan(step: StepInput) -> None:
    sent = reparse_request(convert.step_to_pb_columns(step))
    assert convert.is_columnar(sent) and not sent.running and not sent.waiting
    assert convert.step_from_pb(sent) == step == convert.step_from_pb(convert.step_to_pb(step))
    plan = plan_step(step)
    answered = pb.PlanStepResponse.FromString(convert.plan_to_pb(plan, columns=True).SerializeToString())
    assert not answered.slices and answered.HasField("slice_columns")
    assert convert.plan_from_pb(answered) == plan == convert.plan_from_pb(convert.plan_to_pb(plan))


def test_an_empty_step_in_columns_is_still_columns() -> None:
    step = seed_step()
    empty = StepInput(step.config, (), (), 0, step.num_free_kv_pages)
    sent = reparse_request(convert.step_to_pb_columns(empty))
    assert convert.is_columnar(sent)
    assert convert.step_from_pb(sent) == empty


def test_unequal_columns_are_rejected_with_the_counts() -> None:
    msg = convert.step_to_pb_columns(seed_step())
    msg.running_columns.priority.append(0)
    n = len(msg.running_columns.request_id)
    with pytest.raises(InvalidArgumentError, match=f"running_columns: .*request_id {n}, .*priority {n + 1}"):
        convert.step_from_pb(msg)


def test_both_forms_at_once_are_rejected() -> None:
    msg = convert.step_to_pb_columns(seed_step())
    msg.running.extend(convert.step_to_pb(seed_step()).running)
    with pytest.raises(InvalidArgumentError, match="either running/waiting or running_columns"):
        convert.step_from_pb(msg)


def test_the_server_answers_columns_with_columns_and_the_same_plan(stub) -> None:
    step = seed_step(3)
    by_messages = stub.PlanStep(convert.step_to_pb(step), timeout=5)
    by_columns = stub.PlanStep(convert.step_to_pb_columns(step), timeout=5)
    assert by_messages.slices and not by_messages.HasField("slice_columns")
    assert not by_columns.slices and by_columns.HasField("slice_columns")
    assert convert.plan_from_pb(by_columns) == convert.plan_from_pb(by_messages) == plan_step(step)


def test_the_server_rejects_unequal_columns(stub) -> None:
    msg = convert.step_to_pb_columns(seed_step(3))
    msg.running_columns.num_output_tokens.append(1)
    with pytest.raises(grpc.RpcError) as err:
        stub.PlanStep(msg, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "every column needs one entry per request" in err.value.details()
