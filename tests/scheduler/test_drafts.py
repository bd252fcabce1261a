"""Speculative-decoding drafts (RequestState.num_draft_tokens): the planner's last pass grants a
decode up to its drafts from what the step left, never changing anything else of the plan; with no
drafts every plan is the one planned without the field, byte for byte."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridserve.errors import InvalidArgumentError
from hybridserve.v1 import scheduler_pb2 as pb
from scheduler_svc import convert
from scheduler_svc.core import MambaCacheMode, RequestState, StepInput, StepPlan, plan_step, rules
from scheduler_svc.core.steady import plan_steady_decodes
from scheduler_svc.service import plan_request
from tests.scheduler.helpers import config, decode, prefill, step
from tests.scheduler.invariants import after_drops
from tests.scheduler.strategies import pinned_step_inputs, step_inputs

PROPERTY = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
PLAIN = config(mamba_cache_mode=MambaCacheMode.NONE, max_num_prefill_tokens_per_step=0, max_num_batched_tokens=20)


def with_drafts(r: RequestState, drafts: int) -> RequestState:
    return r._replace(num_draft_tokens=drafts)


def without_field(s: StepInput) -> StepInput:
    """The step built as before the field existed: seven values a request."""
    return replace(s, running=tuple(RequestState(*r[:7]) for r in s.running))


@st.composite
def drafted_steps(draw: st.DrawFn) -> StepInput:
    """Random steps (with pinned pages or not) whose running decodes ask for drafts, some of them."""
    s = draw(st.one_of(step_inputs(), pinned_step_inputs()))
    drafts = st.one_of(st.integers(0, 4), st.integers(0, 300))
    running = tuple(with_drafts(r, draw(drafts)) if not r.is_prefill and draw(st.booleans()) else r for r in s.running)
    return replace(s, running=running)


def wire(plan: StepPlan, columns: bool = False) -> bytes:
    return convert.plan_to_pb(plan, columns).SerializeToString(deterministic=True)


@PROPERTY
@given(drafted_steps())
def test_no_drafts_plans_what_the_step_without_the_field_plans(s: StepInput) -> None:
    zeroed = replace(s, running=tuple(with_drafts(r, 0) for r in s.running))
    before = without_field(s)
    plan = plan_step(zeroed)
    assert plan == plan_step(before) and plan.stats.num_draft_tokens == 0
    assert wire(plan) == wire(plan_step(before)) and wire(plan, True) == wire(plan_step(before), True)
    sent = convert.step_to_pb_columns(zeroed)
    assert not sent.running_columns.num_draft_tokens  # nothing on the wire for all zeros
    assert sent.SerializeToString(deterministic=True) == convert.step_to_pb_columns(before).SerializeToString(
        deterministic=True
    )
    assert plan_request(sent) == plan


@PROPERTY
@given(drafted_steps())
def test_drafts_only_grow_decode_slices_within_every_limit(s: StepInput) -> None:
    cfg, page = s.config, s.config.kv_page_size
    plan = plan_step(s)
    base = plan_step(replace(s, running=tuple(with_drafts(r, 0) for r in s.running)))
    assert (plan.preempted_request_ids, plan.quantum) == (base.preempted_request_ids, base.quantum)
    assert (plan.dropped_prefix_request_ids, plan.failed_request_ids) == (
        base.dropped_prefix_request_ids,
        base.failed_request_ids,
    )
    assert [(x.request_id, x.is_prefill) for x in plan.slices] == [(x.request_id, x.is_prefill) for x in base.slices]
    s = after_drops(s, plan.dropped_prefix_request_ids)  # the step the plan is a plan of
    by_id = {r.request_id: r for r in s.running + s.waiting}
    granted = 0
    for got, was in zip(plan.slices, base.slices, strict=True):
        r, e = by_id[got.request_id], got.num_tokens - was.num_tokens
        if got.is_prefill:
            assert got == was
            continue
        c = r.num_computed_tokens
        assert 0 <= e <= r.num_draft_tokens and e <= max(r.max_tokens - r.num_output_tokens - 1, 0)
        if cfg.is_aligned and e:  # the span [c, c + 1 + e) ends before the next boundary after c
            assert c + 1 + e < (c // cfg.block_size + 1) * cfg.block_size
        assert got.ends_on_checkpoint == (cfg.is_aligned and (c + got.num_tokens) % cfg.block_size == 0)
        granted += e
    pages = sum(
        rules.new_pages_needed(by_id[x.request_id].num_computed_tokens, x.num_tokens, page) for x in plan.slices
    )
    freed = sum(rules.pages_for_tokens(by_id[i].num_computed_tokens, page) for i in plan.preempted_request_ids)
    tokens = sum(x.num_tokens for x in plan.slices)
    assert tokens <= cfg.max_num_batched_tokens and pages <= s.num_free_kv_pages + freed
    assert plan.stats == replace(
        base.stats,
        num_decode_tokens=base.stats.num_decode_tokens + granted,
        num_kv_pages_allocated=pages,
        num_draft_tokens=granted,
    )
    # Nothing left unused: a decode short of its drafts hit its limit, the budget or the pages.
    tokens_left, pages_left = cfg.max_num_batched_tokens - tokens, s.num_free_kv_pages + freed - pages
    for x in plan.slices:
        r = by_id[x.request_id]
        grid = cfg.block_size if cfg.is_aligned else 0
        limit = rules.draft_limit(r.num_computed_tokens, r.num_output_tokens, r.max_tokens, grid)
        if not x.is_prefill and x.num_tokens - 1 < min(r.num_draft_tokens, limit):
            more = rules.new_pages_needed(r.num_computed_tokens, x.num_tokens + 1, page) - rules.new_pages_needed(
                r.num_computed_tokens, x.num_tokens, page
            )
            assert tokens_left == 0 or more > pages_left, (r, x)


@PROPERTY
@given(drafted_steps())
def test_drafts_cross_the_wire_in_both_forms(s: StepInput) -> None:
    assert convert.step_from_pb(convert.step_to_pb(s)) == s == convert.step_from_pb(convert.step_to_pb_columns(s))
    plan = plan_step(s)
    assert convert.plan_from_pb(pb.PlanStepResponse.FromString(wire(plan))) == plan
    assert plan_request(convert.step_to_pb_columns(s)) == plan


def test_drafts_take_only_the_leftover_budget_in_queue_order() -> None:
    # 2 decode tokens + a 6-token prompt leave 12 of 20: the earlier decode takes 8, the next one 4.
    running = [with_drafts(decode("a", arrival=1.0), 8), with_drafts(decode("b", arrival=0.0), 8)]
    plan = plan_step(step(PLAIN, running, [prefill("w", 6, arrival=2.0)]))
    assert [(x.request_id, x.num_tokens) for x in plan.slices] == [("b", 9), ("a", 5), ("w", 6)]
    assert plan.stats.num_draft_tokens == 12 and plan.stats.num_decode_tokens == 14
    assert plan.stats.prefill_budget_tokens == 18  # planned before the drafts, as without them
    full = plan_step(step(replace(PLAIN, max_num_batched_tokens=3), running, [prefill("w", 6)]))
    assert [x.num_tokens for x in full.slices] == [1, 1, 1]  # the prefill's token comes first


def test_drafts_stop_at_the_generation_limit() -> None:
    near = RequestState("n", 100, 102, 3, 5, 0, 0.0, 10)  # 3 outputs of 5: the decode + 1 draft
    last = RequestState("l", 100, 103, 4, 5, 0, 1.0, 10)  # its decode samples the last token
    plan = plan_step(step(PLAIN, [near, last]))
    assert [x.num_tokens for x in plan.slices] == [2, 1] and plan.stats.num_draft_tokens == 1


def test_drafts_stop_at_the_next_block_boundary_in_align_mode() -> None:
    aligned = config(block_size=256, mamba_block_size=64, max_num_prefill_tokens_per_step=0)
    at_250 = with_drafts(decode("x", prompt=200, output=51), 10)  # computed 250: the span ends before 256
    at_255 = with_drafts(decode("y", prompt=200, output=56), 10)  # computed 255: its decode ends on 256
    plan = plan_step(step(aligned, [at_250, at_255]))
    assert [(x.num_tokens, x.ends_on_checkpoint) for x in plan.slices] == [(5, False), (1, True)]
    loose = plan_step(step(replace(aligned, mamba_cache_mode=MambaCacheMode.NONE), [at_250, at_255]))
    assert [x.num_tokens for x in loose.slices] == [11, 11]


def test_drafts_use_only_free_pages_and_never_preempt() -> None:
    on_page = with_drafts(decode("p", prompt=30, output=3), 20)  # computed 32: its decode opens a page
    assert [x.num_tokens for x in plan_step(step(PLAIN, [on_page], free_pages=1)).slices] == [16]
    assert [x.num_tokens for x in plan_step(step(PLAIN, [on_page], free_pages=2)).slices] == [20]
    mid_page = with_drafts(decode("m", prompt=40, output=1), 20)  # computed 40: room for 8 in its page
    other = decode("o", prompt=60, output=5, arrival=0.0)  # computed 64: its decode needs the free page
    plan = plan_step(step(replace(PLAIN, max_num_batched_tokens=100), [mid_page, other], free_pages=1))
    assert [(x.request_id, x.num_tokens) for x in plan.slices] == [("m", 8), ("o", 1)]
    assert plan.stats.num_kv_pages_allocated == 1 and not plan.preempted_request_ids


def test_the_steady_path_leaves_drafts_to_plan_step() -> None:
    s = step(PLAIN, [with_drafts(decode("a"), 3), decode("b")])
    columns = convert.columns_from_pb(convert.step_to_pb_columns(s).running_columns)
    assert plan_steady_decodes(PLAIN, columns, 0, 0, s.num_free_kv_pages) is None
    assert [x.num_tokens for x in plan_request(convert.step_to_pb_columns(s)).slices] == [4, 1]


BAD_DRAFTS = {
    "waiting": (step(PLAIN, [], [with_drafts(prefill("w", 50), 2)]), "on a waiting request"),
    "prefill": (step(PLAIN, [with_drafts(prefill("p", 50, computed=10), 2)]), "while prefilling"),
    "negative": (step(PLAIN, [with_drafts(decode("d"), -1)]), "must be >= 0"),
}


@pytest.mark.parametrize("name", list(BAD_DRAFTS))
def test_drafts_off_a_running_decode_are_invalid(name: str) -> None:
    bad, why = BAD_DRAFTS[name]
    with pytest.raises(InvalidArgumentError, match=f"num_draft_tokens = -?[12] .*{why}"):
        plan_step(bad)


@pytest.mark.parametrize("name", list(BAD_DRAFTS))
@pytest.mark.parametrize("columns", [False, True])
def test_the_server_rejects_drafts_off_a_running_decode(stub, name: str, columns: bool) -> None:
    bad, why = BAD_DRAFTS[name]
    with pytest.raises(grpc.RpcError) as err:
        stub.PlanStep((convert.step_to_pb_columns if columns else convert.step_to_pb)(bad), timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_draft_tokens" in err.value.details() and why in err.value.details()


def test_the_server_grants_drafts_over_the_wire_in_both_forms(stub) -> None:
    s = step(PLAIN, [with_drafts(decode("a"), 3), decode("b"), with_drafts(decode("c"), 50)])
    by_rows = stub.PlanStep(convert.step_to_pb(s), timeout=5)
    by_columns = stub.PlanStep(convert.step_to_pb_columns(s), timeout=5)
    assert list(by_columns.slice_columns.num_tokens) == [4, 1, 15] and by_columns.stats.num_draft_tokens == 17
    assert convert.plan_from_pb(by_rows) == convert.plan_from_pb(by_columns) == plan_step(s)


def test_the_server_rejects_a_draft_column_of_the_wrong_length(stub) -> None:
    msg = convert.step_to_pb_columns(step(PLAIN, [with_drafts(decode("a"), 3), decode("b")]))
    msg.running_columns.num_draft_tokens.append(1)
    with pytest.raises(grpc.RpcError) as err:
        stub.PlanStep(msg, timeout=5)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "num_draft_tokens 3" in err.value.details() and "may be empty" in err.value.details()
