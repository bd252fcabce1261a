"""Plans that once went wrong, found by the property tests, kept as plain examples."""

from __future__ import annotations

from scheduler_svc.core import MambaCacheMode, RequestState, SchedulerConfig, StepInput, plan_step
from tests.scheduler import helpers
from tests.scheduler.helpers import decode, prefill, step
from tests.scheduler.invariants import check_plan


def test_prefills_holding_each_others_pages_do_not_deadlock():
    """Two running prefills hold every page and each needs one more; with no decode to finish, the
    later one must be preempted so the earlier one advances (found by the page-pressure simulation)."""
    config = SchedulerConfig(
        max_num_batched_tokens=3, max_num_seqs=2, long_prefill_token_threshold=0, max_num_prefill_tokens_per_step=0,
        block_size=16, mamba_block_size=16, mamba_cache_mode=MambaCacheMode.ALIGN, kv_page_size=1,
    )  # fmt: skip
    earlier = RequestState("q0", 19, 18, 0, 1, 0, 0.0)
    later = RequestState("q1", 3, 2, 0, 1, 0, 1.0)
    step = StepInput(config, (earlier, later), (), 7, num_free_kv_pages=0)
    plan = plan_step(step)
    check_plan(step, plan)
    assert plan.preempted_request_ids == ("q1",)
    assert [(s.request_id, s.num_tokens) for s in plan.slices] == [("q0", 1)]


def test_alignment_waste_is_offered_again_to_the_same_prefill():
    """A 256-token offer that alignment cut to 235 left 128 unused although the whole 257-token tail
    fitted (found by the deep property run): the re-offer must let it finish the prompt."""
    config = SchedulerConfig(
        max_num_batched_tokens=364, max_num_seqs=3, long_prefill_token_threshold=0,
        max_num_prefill_tokens_per_step=384, block_size=128, mamba_block_size=16,
        mamba_cache_mode=MambaCacheMode.ALIGN, kv_page_size=4,
    )  # fmt: skip
    decode = RequestState("r0", 1, 1, 1, 1, 0, 0.0)
    waiting = RequestState("w0", 278, 21, 0, 1, 0, 0.0)
    step = StepInput(config, (decode,), (waiting,), 0, num_free_kv_pages=64)
    plan = plan_step(step)
    check_plan(step, plan)
    assert {s.request_id: s.num_tokens for s in plan.slices} == {"r0": 1, "w0": 257}


def test_requests_waiting_for_a_seat_while_every_seat_decodes_are_not_a_stall():
    """max_num_seqs requests decoding and more waiting: the waiting ones have no place in the step,
    so the step is queued, not stalled (the worker's stalled-steps counter, a qualify gate)."""
    cfg = helpers.config(max_num_batched_tokens=2048, max_num_seqs=4, max_num_prefill_tokens_per_step=0, block_size=256,
                 mamba_block_size=64)  # fmt: skip
    running = [decode(f"d{i}") for i in range(4)]
    plan = plan_step(step(cfg, running, [prefill("w0", 100, arrival=1.0)]))
    assert plan.stats.num_pending_prefills == 1 and plan.stats.num_prefill_tokens == 0
    assert not plan.stats.stalled
    plan = plan_step(step(cfg, running[:3], [prefill("w0", 100, arrival=1.0)], free_pages=0))
    assert plan.stats.stalled  # a seat was free and nothing was admitted (no page for it)
