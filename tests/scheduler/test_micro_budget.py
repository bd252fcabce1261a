"""The mixed-prefill budget bounds every prefill token of a step that carries decodes: the prompts of
every length share max_num_prefill_tokens_per_step in quanta, rotating, work conserving (guarantee 1
of docs/design.md, Planning rules). Exempting short prompts is a field of its own,
micro_slice_long_prompts_only, off by default."""

from __future__ import annotations

from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from scheduler_svc.core import StepInput, plan_step
from tests.scheduler.helpers import config, decode, prefill, step
from tests.scheduler.invariants import check_plan
from tests.scheduler.strategies import step_inputs

# 8,192-token steps, a 4,096-token mixed-prefill budget, 2,048 / 256 grids (quantum 2,048).
MIXED = config(max_num_batched_tokens=8192, max_num_seqs=32, max_num_prefill_tokens_per_step=4096)


def prefill_slices(s: StepInput) -> dict[str, int]:
    plan = plan_step(s)
    check_plan(s, plan)
    return {sl.request_id: sl.num_tokens for sl in plan.slices if sl.is_prefill}


def mixed_step(step_index: int = 0, long_only: bool = False) -> StepInput:
    running = [decode("d0"), decode("d1")] + [
        prefill(f"p{n}", n, arrival=float(i)) for i, n in enumerate((3000, 16384, 7000, 100))
    ]
    return step(replace(MIXED, micro_slice_long_prompts_only=long_only), running, step_index=step_index)


def test_the_four_prompts_beside_two_decodes_get_at_most_the_budget() -> None:
    for index in range(8):
        slices = prefill_slices(mixed_step(index))
        assert sum(slices.values()) <= 4096
        # two quanta over four prefills, rotating; the 100-token prompt's quantum leaves 1,948 tokens
        # that no other prefill can use: none finishes in them, and the rest must end on the 2,048 grid
        assert sorted(slices.values()) in ([2048, 2048], [100, 2048])


def test_each_of_the_four_advances_within_two_steps_and_the_short_one_finishes() -> None:
    seen: dict[str, int] = {}
    for index in range(2):  # P = 4 prefills, k = 2 quanta a step: ceil(4 / 2) = 2 steps
        for rid, n in prefill_slices(mixed_step(index)).items():
            seen[rid] = seen.get(rid, 0) + n
    assert set(seen) == {"p3000", "p16384", "p7000", "p100"} and seen["p100"] == 100


def test_a_short_prompt_left_over_quanta_go_to_the_next_prefill() -> None:
    running = [decode("d0"), prefill("short", 100), prefill("long", 16384, arrival=1.0)]
    slices = prefill_slices(step(MIXED, running))
    assert slices == {"short": 100, "long": 2048}  # the long one takes the second quantum; 1,948 unused


def test_the_long_prompts_only_field_keeps_the_exemption_explicit() -> None:
    slices = prefill_slices(mixed_step(0, long_only=True))
    assert slices["p100"] == 100 and sum(slices.values()) > 4096  # short prompts beside the budget


def test_waiting_prompts_are_admitted_within_what_is_left_of_the_budget() -> None:
    running = [decode("d0"), prefill("r0", 16384, computed=14336)]  # its last 2,048 tokens
    waiting = [prefill("w0", 100, arrival=1.0), prefill("w1", 200, arrival=2.0)]
    slices = prefill_slices(step(MIXED, running, waiting))
    assert slices == {"r0": 2048, "w0": 100, "w1": 200}  # both finish within the second quantum
    assert prefill_slices(step(MIXED, running[1:], waiting)) == {"r0": 2048, "w0": 100, "w1": 200}  # no decode


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(step_inputs(), st.integers(1, 4))
def test_guarantee_one_over_mixed_prompt_lengths(step_input: StepInput, quanta: int) -> None:
    """Random prompt lengths, a budget of 1..4 quanta, the default meaning: the prefill tokens of a
    step with decodes are at most the budget, and every other guarantee holds (check_plan)."""
    cfg = step_input.config
    cfg = replace(cfg, max_num_prefill_tokens_per_step=quanta * cfg.quantum, micro_slice_long_prompts_only=False)
    s = replace(step_input, config=cfg.validate())
    plan = plan_step(s)
    check_plan(s, plan)
    decodes = sum(sl.num_tokens for sl in plan.slices if not sl.is_prefill)
    prefills = sum(sl.num_tokens for sl in plan.slices if sl.is_prefill)
    if decodes:
        assert plan.stats.micro_sliced and prefills <= cfg.max_num_prefill_tokens_per_step


def test_budget_below_a_quantum_finishes_short_prompts_it_holds() -> None:
    """A chunk that finishes its prompt needs no grid: what a quantum leaves goes to the prompts
    whose rest fits in it, running or waiting, in rotation order (rules.quanta_offer)."""
    running = [decode("d0"), prefill("a", 300), prefill("b", 500, arrival=1.0), prefill("c", 9000, arrival=2.0)]
    waiting = [prefill("w", 1500, arrival=3.0)]
    slices = prefill_slices(step(MIXED, running, waiting, step_index=0))
    assert sum(slices.values()) <= 4096
    assert slices["a"] == 300 and slices["b"] == 500  # both finish; c's quantum ends on the grid
    assert slices.get("c") in (2048, None) and slices.get("w", 0) in (0, 1500)
