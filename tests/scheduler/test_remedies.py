"""The remedies (core/remedies.py) as properties: pinned pages of waiting hits in the step input, a
plan that never takes more pages than are free or reclaimable, never an empty plan with live work,
and with no pinned pages the plans of every step that planned something before."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hybridserve.errors import InvalidArgumentError
from scheduler_svc import convert
from scheduler_svc.core import PinnedPages, RequestState, SchedulerConfig, StepInput, StepPlan, plan_step, rules
from scheduler_svc.core.planner import _plan_once
from scheduler_svc.core.remedies import is_empty
from scheduler_svc.service import plan_request
from tests.scheduler.helpers import config, prefill, step
from tests.scheduler.invariants import after_drops, check_plan
from tests.scheduler.simulator import Simulation
from tests.scheduler.strategies import configs, pinned_step_inputs, step_inputs

PROPERTY = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def pages_taken(step: StepInput, plan: StepPlan) -> int:
    """Pages the plan's slices take, from the states as the plan leaves them (dropped hits at 0)."""
    after = after_drops(step, plan.dropped_prefix_request_ids)
    by_id = {r.request_id: r for r in after.running + after.waiting}
    page = step.config.kv_page_size
    return sum(rules.new_pages_needed(by_id[s.request_id].num_computed_tokens, s.num_tokens, page) for s in plan.slices)


@PROPERTY
@given(pinned_step_inputs())
def test_every_plan_keeps_the_guarantees_with_pinned_pages(step: StepInput) -> None:
    check_plan(step, plan_step(step))


@PROPERTY
@given(pinned_step_inputs())
def test_a_plan_never_takes_more_pages_than_free_and_reclaimable(step: StepInput) -> None:
    plan = plan_step(step)
    page = step.config.kv_page_size
    by_id = {r.request_id: r for r in step.running}
    freed = sum(rules.pages_for_tokens(by_id[rid].num_computed_tokens, page) for rid in plan.preempted_request_ids)
    pinned = {p.request_id: p.num_kv_pages for p in step.pinned_kv_pages}
    reclaimed = sum(pinned.get(rid, 0) for rid in plan.dropped_prefix_request_ids)
    assert pages_taken(step, plan) <= step.num_free_kv_pages + freed + reclaimed
    assert plan.stats.num_kv_pages_allocated == pages_taken(step, plan)


@PROPERTY
@given(pinned_step_inputs())
def test_when_nothing_else_can_progress_the_plan_carries_a_remedy(step: StepInput) -> None:
    plan = plan_step(step)
    if step.running or step.waiting:
        assert not is_empty(plan), "an empty plan with live work"
    remedied = plan.dropped_prefix_request_ids or plan.failed_request_ids
    assert not remedied or is_empty(_plan_once(step)), "a remedy where the step planned something"


@PROPERTY
@given(step_inputs())
def test_with_no_pinned_pages_every_plan_that_schedules_is_todays(step: StepInput) -> None:
    """Steps 1-5 (planner._plan_once) are the planner as it was; the remedies touch only a plan
    that would be empty with live work, and a plan without them puts no new field on the wire."""
    plan, before = plan_step(step), _plan_once(step)
    if not is_empty(before) or not (step.running or step.waiting):
        assert plan == before
        encoded = convert.plan_to_pb(plan).SerializeToString(deterministic=True)
        assert encoded == convert.plan_to_pb(before).SerializeToString(deterministic=True)
        sent = convert.plan_to_pb(plan)
        assert not sent.dropped_prefix_request_ids and not sent.failed_request_ids
    assert not convert.step_to_pb(step).pinned_kv_pages


@PROPERTY
@given(pinned_step_inputs())
def test_pinned_pages_change_only_the_plans_that_drop_hits(step: StepInput) -> None:
    plan = plan_step(step)
    if not plan.dropped_prefix_request_ids:
        assert plan == plan_step(replace(step, pinned_kv_pages=()))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(pinned_step_inputs())
def test_pinned_pages_round_trip_and_plan_alike_in_both_forms(step: StepInput) -> None:
    assert (
        convert.step_from_pb(convert.step_to_pb(step)) == step == convert.step_from_pb(convert.step_to_pb_columns(step))
    )
    plan = plan_step(step)
    assert convert.plan_from_pb(convert.plan_to_pb(plan)) == plan
    assert plan_request(convert.step_to_pb_columns(step)) == plan == plan_request(convert.step_to_pb(step))


def test_hits_that_pin_the_pool_are_dropped_from_the_back_and_the_head_is_admitted() -> None:
    cfg = config(block_size=16, mamba_block_size=16, kv_page_size=16, max_num_batched_tokens=64, max_num_seqs=4)
    head = prefill("head", 40, computed=32, arrival=0.0)  # 2 pages hit, needs 1 more
    late = prefill("late", 40, computed=32, arrival=1.0)
    pinned = (PinnedPages("head", 2), PinnedPages("late", 2))
    stuck = replace(step(cfg, waiting=[late, head], free_pages=0), pinned_kv_pages=pinned)
    plan = plan_step(stuck)
    assert plan.dropped_prefix_request_ids == ("late",) and not plan.failed_request_ids
    # the head keeps its hit and finishes its prompt; the late one starts over with the page left
    assert [(s.request_id, s.num_tokens) for s in plan.slices] == [("head", 8), ("late", 16)]
    check_plan(stuck, plan)
    # Pages the hits share are counted for neither: dropping both frees nothing this plan can count,
    # so it plans nothing else and fails nothing; the next step's free pages show what came back.
    shared = plan_step(replace(stuck, pinned_kv_pages=()))
    assert shared.dropped_prefix_request_ids == ("late", "head") and not shared.slices
    assert not shared.failed_request_ids
    next_step = step(cfg, waiting=[late._replace(num_computed_tokens=0), head._replace(num_computed_tokens=0)],
                     free_pages=2)  # fmt: skip
    assert [s.request_id for s in plan_step(next_step).slices] == ["head"]


def test_a_prefill_longer_than_the_pool_fails_and_nothing_else_does() -> None:
    cfg = config(block_size=16, mamba_block_size=16, kv_page_size=16, max_num_batched_tokens=64, max_num_seqs=4)
    alone = step(cfg, running=[prefill("big", 400, computed=32)], free_pages=0)
    plan = plan_step(alone)
    assert plan.failed_request_ids == ("big",) and not plan.slices and not plan.preempted_request_ids
    waiting = step(cfg, waiting=[prefill("w", 400)], free_pages=0)
    assert plan_step(waiting).failed_request_ids == ("w",)
    assert plan_step(replace(waiting, num_free_kv_pages=1)).slices  # one page: a chunk fits


@pytest.mark.parametrize(
    ("pinned", "message"),
    [
        ((PinnedPages("nobody", 1),), "no waiting request has this id"),
        ((PinnedPages("running", 1),), "no waiting request has this id"),
        ((PinnedPages("hit", 1), PinnedPages("hit", 1)), "listed twice"),
        ((PinnedPages("hit", 3),), "at most the 2 pages of its 32 computed tokens"),
        ((PinnedPages("hit", -1),), "must be >= 0"),
        ((PinnedPages("fresh", 0),), "has no prefix-cache hit"),
    ],
)
def test_pinned_pages_that_do_not_match_a_waiting_hit_are_rejected(pinned: tuple[PinnedPages, ...], message: str):
    cfg = config(block_size=16, mamba_block_size=16, kv_page_size=16)
    running = RequestState("running", 10, 10, 1, 20, 0, 0.0)
    bad = replace(step(cfg, [running], [prefill("hit", 40, computed=32), prefill("fresh", 40)]), pinned_kv_pages=pinned)
    with pytest.raises(InvalidArgumentError, match=message):
        plan_step(bad)
    with pytest.raises(InvalidArgumentError, match=message):
        plan_request(convert.step_to_pb_columns(bad))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(max_block=256), st.data())
def test_hits_that_pin_a_tight_pool_never_stall_a_simulation(config: SchedulerConfig, data: st.DataObject) -> None:
    """Requests start waiting with hits of whole blocks pinning their pages, in a pool barely
    larger than the largest request: each plan fed back, no plan is empty, every request finishes,
    and none fails (each fits the pool alone, so none can be one that never fits)."""
    sim = Simulation.random(config, data.draw, total_pages=None)
    page = config.kv_page_size
    pinned: dict[str, int] = {}
    for r in sim.requests:  # hits as long as the pool holds them
        hit = data.draw(st.integers(0, (r.prompt - 1) // config.block_size)) * config.block_size
        if hit and sum(pinned.values()) + rules.pages_for_tokens(hit, page) <= sim.total_pages:
            r.computed, pinned[r.request_id] = hit, rules.pages_for_tokens(hit, page)
    bound = 40 * (sum(r.prompt + r.max_tokens for r in sim.requests) + len(sim.requests))
    for _ in range(bound):
        if sim.all_finished():
            break
        waiting_ids = {r.request_id for r in sim.waiting}
        step = StepInput(
            config, tuple(r.state() for r in sim.running), tuple(r.state() for r in sim.waiting), sim.step_index,
            sim.total_pages - sim.used_pages() - sum(pinned.values()), None,
            tuple(PinnedPages(rid, n) for rid, n in pinned.items() if rid in waiting_ids),
        )  # fmt: skip
        plan = plan_step(step)
        check_plan(step, plan)
        assert not is_empty(plan) and not plan.failed_request_ids, (plan, sim.describe())
        for rid in plan.dropped_prefix_request_ids:
            next(r for r in sim.waiting if r.request_id == rid).computed = 0
            pinned.pop(rid, None)
        sim.apply(plan)
        waiting_ids = {r.request_id for r in sim.waiting}
        for rid in [rid for rid in pinned if rid not in waiting_ids]:  # admitted: its hit's pages are its own now
            del pinned[rid]
        sim.step_index += 1
    assert sim.all_finished(), f"unfinished after {bound} steps; {sim.describe()}"
