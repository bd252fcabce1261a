"""The steady-decode path (core/steady.py) plans what plan_step plans, byte for byte on the wire,
takes only the steps it is meant for, and leaves every invalid input to plan_step's errors."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridserve.errors import InvalidArgumentError
from hybridserve.v1 import scheduler_pb2 as pb
from scheduler_svc import convert
from scheduler_svc.core import PinnedPages, RequestState, StepInput, plan_step
from scheduler_svc.core.steady import StateColumns, plan_steady_decodes
from scheduler_svc.service import plan_request
from tests.scheduler.helpers import config
from tests.scheduler.strategies import configs, pinned_step_inputs, step_inputs


def columns_of(states: tuple[RequestState, ...]) -> StateColumns:
    return (
        StateColumns(*(list(column) for column in zip(*states, strict=True)))
        if states
        else StateColumns([], [], [], [], [], [], [])
    )


def steady(step: StepInput):  # type: ignore[no-untyped-def]
    return plan_steady_decodes(
        step.config, columns_of(step.running), len(step.waiting), step.step_index, step.num_free_kv_pages, step.share
    )


@st.composite
def decode_steps(draw: st.DrawFn) -> StepInput:
    """Running decodes only, in any queue order, with pages that may or may not suffice."""
    cfg = draw(configs())
    n = draw(st.integers(1, cfg.max_num_seqs))
    running = []
    for i in range(n):
        prompt, output = draw(st.integers(1, 600)), draw(st.integers(1, 300))
        running.append(RequestState(
            f"r{i}", prompt, prompt + output - 1, output, output + draw(st.integers(0, 9)),
            draw(st.integers(0, 2)), float(draw(st.integers(0, 20))),
        ))  # fmt: skip
    return StepInput(cfg, tuple(running), (), draw(st.integers(0, 10_000)), draw(st.integers(0, 2 * n)))


@settings(max_examples=300, deadline=None)
@given(decode_steps())
def test_steady_decode_steps_get_plan_steps_plan(step: StepInput) -> None:
    plan = steady(step)
    expected = plan_step(step)
    if plan is None:  # declined: only when the pages or the budget do not cover every decode
        assert expected.preempted_request_ids or len(expected.slices) < len(step.running)
        return
    assert plan == expected
    assert convert.plan_to_pb(plan, True).SerializeToString(deterministic=True) == convert.plan_to_pb(
        expected, True
    ).SerializeToString(deterministic=True)


@settings(max_examples=300, deadline=None)
@given(step_inputs())
def test_any_step_it_takes_is_planned_alike(step: StepInput) -> None:
    plan = steady(step)
    if plan is not None:
        assert not step.waiting and all(not r.is_prefill for r in step.running)
        assert plan == plan_step(step)


def test_it_declines_prefills_waiting_requests_and_short_pages() -> None:
    cfg = config(block_size=16, mamba_block_size=16, kv_page_size=16, max_num_batched_tokens=64, max_num_seqs=8)
    d0 = RequestState("d0", 10, 15, 6, 20, 0, 0.0)  # position 15: its token ends block 0 (a checkpoint)
    d1 = RequestState("d1", 16, 16, 1, 20, 0, 1.0)  # position 16 starts a new page
    base = StepInput(cfg, (d0, d1), (), 3, 1)
    plan = steady(base)
    assert plan is not None and plan == plan_step(base)
    assert [(s.request_id, s.num_tokens, s.ends_on_checkpoint) for s in plan.slices] == [
        ("d0", 1, True),
        ("d1", 1, False),
    ]
    assert plan.stats.num_kv_pages_allocated == 1
    assert steady(replace(base, num_free_kv_pages=0)) is None  # d1's page would preempt someone
    assert steady(replace(base, waiting=(RequestState("w", 5, 0, 0, 4, 0, 2.0),))) is None
    assert steady(replace(base, running=(d0, RequestState("p", 40, 16, 0, 4, 0, 2.0)))) is None
    reordered = replace(base, running=(d1._replace(arrival_time=-1.0), d0))
    assert steady(reordered) == plan_step(reordered)  # queue order, not worker order
    assert [s.request_id for s in plan_step(replace(base, running=(d1, d0._replace(priority=-1)))).slices] == [
        "d0",
        "d1",
    ]


@settings(max_examples=300, deadline=None)
@given(st.one_of(pinned_step_inputs(), decode_steps()))
def test_steps_with_pinned_pages_are_planned_alike_on_both_paths(step: StepInput) -> None:
    """Pinned pages belong to waiting requests, so the steady path never takes such a step; the
    servicer's columns dispatch plans it as plan_step does, remedies included."""
    if step.pinned_kv_pages:
        assert steady(step) is None
    sent = pb.PlanStepRequest.FromString(convert.step_to_pb_columns(step).SerializeToString())
    assert plan_request(sent) == plan_step(step) == plan_request(convert.step_to_pb(step))


def test_a_steady_step_with_pinned_pages_is_rejected_as_plan_step_rejects_it() -> None:
    step = StepInput(config(), (RequestState("d0", 10, 10, 1, 20, 0, 0.0),), (), 0, 100, None, (PinnedPages("d0", 1),))
    with pytest.raises(InvalidArgumentError, match="no waiting request has this id"):
        plan_step(step)
    with pytest.raises(InvalidArgumentError, match="no waiting request has this id"):
        plan_request(convert.step_to_pb_columns(step))


@pytest.mark.parametrize(
    "bad",
    [
        RequestState("d1", 16, 20, 1, 20, 0, 1.0),  # computed beyond prompt + outputs - 1
        RequestState("d1", 16, 16, 1, 0, 0, 1.0),  # max_tokens below the outputs
        RequestState("d0", 16, 16, 1, 20, 0, 1.0),  # a duplicate id
        RequestState("", 16, 16, 1, 20, 0, 1.0),  # no id
        RequestState("d1", 16, 16, 1, 20, 0, float("nan")),
    ],
)
def test_invalid_input_is_left_to_plan_steps_errors(bad: RequestState) -> None:
    step = StepInput(config(), (RequestState("d0", 10, 10, 1, 20, 0, 0.0), bad), (), 0, 100)
    assert steady(step) is None
    with pytest.raises(InvalidArgumentError):
        plan_step(step)
    with pytest.raises(InvalidArgumentError):
        plan_request(convert.step_to_pb_columns(step))


def test_the_servicer_takes_it_for_columns_only() -> None:
    step = StepInput(config(), (RequestState("d0", 10, 10, 1, 20, 0, 0.0),), (), 0, 100)
    by_columns = plan_request(pb.PlanStepRequest.FromString(convert.step_to_pb_columns(step).SerializeToString()))
    assert by_columns == plan_request(convert.step_to_pb(step)) == plan_step(step)
    with pytest.raises(InvalidArgumentError, match="mamba_block_size"):
        plan_request(convert.step_to_pb_columns(replace(step, config=replace(step.config, mamba_block_size=0))))
