"""Converters round-trip, and reject what the wire allows but the domain does not."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from hybridserve.errors import InvalidArgumentError
from hybridserve.v1 import scheduler_pb2 as pb
from scheduler_svc import convert
from scheduler_svc.core import plan_step
from tests.scheduler.strategies import step_inputs


@settings(max_examples=100, deadline=None)
@given(step_inputs())
def test_step_and_plan_round_trip(step):
    assert convert.step_from_pb(convert.step_to_pb(step)) == step
    plan = plan_step(step)
    assert convert.plan_from_pb(convert.plan_to_pb(plan)) == plan


def test_absent_config_and_unknown_mode_are_rejected():
    with pytest.raises(InvalidArgumentError, match="config is required"):
        convert.step_from_pb(pb.PlanStepRequest())
    with pytest.raises(InvalidArgumentError, match="mamba_cache_mode = 5"):
        convert.config_from_pb(pb.SchedulerConfig(mamba_cache_mode=5))
