"""The planning guarantees (docs/design.md; with pinned pages also in test_remedies.py) as properties over random
configs and request sets, one step at a time and over multi-step simulations that feed every plan back into the
state."""

from __future__ import annotations

import math
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc import convert
from scheduler_svc.core import PrefillShareMode, RequestState, StepInput, plan_step
from tests.scheduler.invariants import check_plan
from tests.scheduler.simulator import Simulation
from tests.scheduler.strategies import configs, step_inputs

PROPERTY = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(step_inputs())
def test_every_plan_keeps_guarantees_1_2_3_5_6_8(step: StepInput):
    check_plan(step, plan_step(step))


@PROPERTY
@given(step_inputs())
def test_deterministic_byte_for_byte(step: StepInput):  # guarantee 7
    first = convert.plan_to_pb(plan_step(step)).SerializeToString(deterministic=True)
    again = convert.plan_to_pb(plan_step(convert.step_from_pb(convert.step_to_pb(step)))).SerializeToString(
        deterministic=True
    )
    assert first == again


@settings(max_examples=150, deadline=None)
@given(configs(), st.integers(2, 7), st.integers(1, 3), st.integers(1, 6), st.integers(0, 1000))
def test_fairness_each_prefill_advances_within_ceil_p_over_k_steps(config, num_prefills, num_decodes, k, start):
    """Guarantee 4: with P pending prefills and k quanta per step, each prefill advances within
    ceil(P/k) steps (stable set, ample capacity, micro-slicing on)."""
    config = replace(
        config, long_prefill_token_threshold=0, max_num_prefill_tokens_per_step=0, max_num_batched_tokens=10**6,
        prefill_share_mode=PrefillShareMode.OFF,
    )  # fmt: skip
    micro = k * config.quantum
    config = replace(
        config,
        max_num_seqs=num_prefills + num_decodes,
        max_num_batched_tokens=micro + num_decodes,
        max_num_prefill_tokens_per_step=micro,
    ).validate()
    assert config.quantum == micro // k
    window = math.ceil(num_prefills / k)
    decodes = [RequestState(f"d{i}", 10, 10 + 5 - 1, 5, 10_000, 0, -1.0) for i in range(num_decodes)]
    prefills = [RequestState(f"p{i}", 10**9, 0, 0, 1, 0, float(i)) for i in range(num_prefills)]
    last_served = {p.request_id: start - 1 for p in prefills}
    for index in range(start, start + 3 * window + 2):
        step = StepInput(config, tuple(decodes + prefills), (), index, 10**9)
        plan = plan_step(step)
        check_plan(step, plan)
        served = {s.request_id: s.num_tokens for s in plan.slices if s.is_prefill}
        assert plan.stats.micro_sliced and sum(served.values()) > 0
        prefills = [
            p._replace(num_computed_tokens=p.num_computed_tokens + served.get(p.request_id, 0)) for p in prefills
        ]
        for rid in served:
            last_served[rid] = index
        for rid, when in last_served.items():
            assert index - when < window, f"{rid} waited more than ceil(P/k) = {window} steps"


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(max_block=256), st.data())
def test_simulation_with_ample_pages_finishes_every_request(config, data):
    """Every plan fed back: each step computes at least one token while work is pending (no empty
    step), every request finishes, and nothing is preempted when pages are ample."""
    sim = Simulation.random(config, data.draw, total_pages=10**7)
    bound = sum(r.prompt + r.max_tokens for r in sim.requests) + len(sim.requests)
    steps = sim.run(max_steps=bound, check=check_plan)
    assert sim.all_finished(), f"unfinished after {steps} steps (bound {bound})"
    assert sim.num_preemptions == 0


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(configs(max_block=256), st.data())
def test_simulation_under_page_pressure_finishes_every_request(config, data):
    """A pool barely larger than the largest request: preemption happens, nothing deadlocks, every
    request finishes within the bound (each step computes >= 1 token, recompute counted)."""
    sim = Simulation.random(config, data.draw, total_pages=None)
    bound = 40 * (sum(r.prompt + r.max_tokens for r in sim.requests) + len(sim.requests))
    steps = sim.run(max_steps=bound, check=check_plan)
    assert sim.all_finished(), f"unfinished after {steps} steps; {sim.describe()}"
