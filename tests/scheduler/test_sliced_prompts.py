"""Micro-slicing in its long-prompts-only mode (SchedulerConfig.micro_slice_long_prompts_only) caps
the prompts longer than its budget (rules.sliced_prompt_threshold); the prompts that fit in it are planned
as plain chunked prefill plans them. By default every prefill token counts
(tests/scheduler/test_micro_budget.py)."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.core import PrefillShareMode, StepInput, plan_step, rules
from tests.scheduler.helpers import config, decode, prefill, step
from tests.scheduler.invariants import check_plan
from tests.scheduler.strategies import step_inputs

# 2048-token steps, 512-token micro budget, 256-token grid (quantum 256): the convoy's profile.
CONVOY = config(max_num_batched_tokens=2048, max_num_seqs=32, max_num_prefill_tokens_per_step=512,
                block_size=256, mamba_block_size=64, micro_slice_long_prompts_only=True)  # fmt: skip


def prefills_of(s: StepInput) -> dict[str, int]:
    plan = plan_step(s)
    check_plan(s, plan)
    return {sl.request_id: sl.num_tokens for sl in plan.slices if sl.is_prefill}


def test_the_sliced_prompts_are_those_longer_than_the_budget_and_by_default_all() -> None:
    assert rules.sliced_prompt_threshold(512, True) == 512  # a 513-token prompt shares it, a 512 one does not
    assert rules.sliced_prompt_threshold(512, False) == 0  # by default every prompt shares the budget
    assert CONVOY.sliced_prompt_threshold == 512


def test_short_prompts_take_the_step_budget_while_a_long_one_is_sliced() -> None:
    running = [decode(f"d{i}") for i in range(8)] + [prefill("long", 6000, computed=512)]
    waiting = [prefill(f"c{i}", 200, arrival=float(i + 1)) for i in range(6)]
    slices = prefills_of(step(CONVOY, running, waiting))
    assert slices["long"] == 512  # the micro budget, whole
    assert all(slices[f"c{i}"] == 200 for i in range(6))  # 1,200 short-prompt tokens beside it
    assert sum(slices.values()) == 1712 > CONVOY.max_num_prefill_tokens_per_step


def test_without_decodes_the_long_prompt_takes_the_whole_step() -> None:
    slices = prefills_of(step(CONVOY, [prefill("long", 6000)]))
    assert slices == {"long": 2048}


def test_long_prompts_share_the_budget_in_quanta_and_short_ones_fill_the_rest() -> None:
    running = [decode("d0")] + [prefill(f"l{i}", 6000, arrival=float(i)) for i in range(3)]
    running += [prefill("short", 400, computed=100, arrival=5.0)]
    for index in range(3):
        slices = prefills_of(step(CONVOY, running, step_index=index))
        longs = sorted(slices.get(f"l{i}", 0) for i in range(3))
        assert longs == [0, 256, 256]  # two quanta over three long prompts, rotating
        assert slices["short"] == 300  # the short one's whole prompt, beside the micro budget


def test_a_waiting_long_prompt_is_admitted_within_the_budget_left_and_short_ones_pass_it() -> None:
    running = [decode("d0"), prefill("l0", 6000, arrival=0.0)]
    waiting = [prefill("l1", 6000, arrival=1.0), prefill("c0", 100, arrival=2.0)]
    slices = prefills_of(step(CONVOY, running, waiting))
    assert slices == {"l0": 512, "c0": 100}  # l1 waits: the long prompts' budget is spent
    slices = prefills_of(step(CONVOY, [decode("d0"), prefill("l0", 6000, computed=5744)], waiting))
    assert slices == {"l0": 256, "l1": 256, "c0": 100}  # l0's tail leaves a quantum to l1


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step_inputs(), st.integers(0, 3))
def test_with_no_prompt_above_the_budget_plans_are_plain_chunked_prefills(step_input: StepInput, extra: int) -> None:
    """The chat workload's case: every prompt fits in the micro budget, so turning micro-slicing on
    changes nothing but the step's micro_sliced flag."""
    cfg = replace(step_input.config, prefill_share_mode=PrefillShareMode.OFF)  # micro-slicing alone
    step_input = replace(step_input, config=cfg, share=None)
    longest = max((r.num_prompt_tokens for r in step_input.running + step_input.waiting), default=1)
    budget = (-(-longest // cfg.quantum) + extra) * cfg.quantum  # a multiple of the quantum >= every prompt
    sliced_cfg = replace(cfg, max_num_prefill_tokens_per_step=budget, micro_slice_long_prompts_only=True).validate()
    plain = plan_step(replace(step_input, config=replace(cfg, max_num_prefill_tokens_per_step=0)))
    sliced_input = replace(step_input, config=sliced_cfg)
    sliced = plan_step(sliced_input)
    check_plan(sliced_input, sliced)
    assert sliced.slices == plain.slices
    assert sliced.preempted_request_ids == plain.preempted_request_ids
    assert sliced.quantum == plain.quantum
    assert replace(sliced.stats, micro_sliced=plain.stats.micro_sliced) == plain.stats
    assert sliced.stats.micro_sliced == (sliced.stats.num_decode_tokens > 0)
