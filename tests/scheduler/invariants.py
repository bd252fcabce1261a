"""Checks of DESIGN §2's guarantees on one (input, plan) pair, written from the guarantees, not
from the planner's code: they recompute caps from the request states and the rule functions."""

from __future__ import annotations

from scheduler_svc.core import RequestState, StepInput, StepPlan, rules


def smallest_useful_chunk(r: RequestState, step: StepInput) -> int:
    """The fewest tokens a prefill could be granted and still advance."""
    cfg = step.config
    left = r.num_prefill_tokens_left
    if not cfg.is_aligned or cfg.sub_block_exception:
        return 1
    next_boundary = (r.num_computed_tokens // cfg.block_size + 1) * cfg.block_size
    return min(left, next_boundary - r.num_computed_tokens)


def check_plan(step: StepInput, plan: StepPlan) -> None:
    cfg = step.config
    by_id = {r.request_id: r for r in step.running + step.waiting}
    running_ids = {r.request_id for r in step.running}
    preempted = set(plan.preempted_request_ids)
    slices = {s.request_id: s for s in plan.slices}
    prefill_tokens = sum(s.num_tokens for s in plan.slices if s.is_prefill)
    decode_tokens = sum(s.num_tokens for s in plan.slices if not s.is_prefill)

    # Shape: each request once, known, positive, not both preempted and scheduled.
    assert len(slices) == len(plan.slices)
    assert preempted <= running_ids and not (preempted & slices.keys())
    for s in plan.slices:
        r = by_id[s.request_id]
        assert s.num_tokens > 0 and s.is_prefill == r.is_prefill
        if r.is_prefill:
            assert s.num_tokens <= r.num_prefill_tokens_left
            if cfg.long_prefill_token_threshold:
                assert s.num_tokens <= cfg.long_prefill_token_threshold
        else:
            assert s.num_tokens == 1 and r.request_id in running_ids
        end = r.num_computed_tokens + s.num_tokens
        assert s.ends_on_checkpoint == (cfg.is_aligned and end % cfg.block_size == 0)
    admitted = [rid for rid in slices if rid not in running_ids]
    if preempted:
        assert not admitted, "no admission in a step that preempts"

    # 1. Limits.
    assert prefill_tokens + decode_tokens <= cfg.max_num_batched_tokens
    assert len(plan.slices) <= cfg.max_num_seqs
    assert len(running_ids) - len(preempted) + len(admitted) <= cfg.max_num_seqs
    micro = decode_tokens > 0 and cfg.max_num_prefill_tokens_per_step > 0
    assert plan.stats.micro_sliced == micro
    if micro:
        assert prefill_tokens <= cfg.max_num_prefill_tokens_per_step
    freed = sum(rules.pages_for_tokens(by_id[rid].num_computed_tokens, cfg.kv_page_size) for rid in preempted)
    pages = sum(
        rules.new_pages_needed(by_id[rid].num_computed_tokens, s.num_tokens, cfg.kv_page_size)
        for rid, s in slices.items()
    )
    assert pages == plan.stats.num_kv_pages_allocated
    assert pages <= step.num_free_kv_pages + freed

    # 2. Alignment: non-final chunks end on the grid, or (sub-block exception) cross no boundary.
    if cfg.is_aligned:
        for rid, s in slices.items():
            r = by_id[rid]
            end = r.num_computed_tokens + s.num_tokens
            if s.is_prefill and end < r.num_prompt_tokens and end % cfg.block_size:
                assert cfg.sub_block_exception
                assert end // cfg.block_size == r.num_computed_tokens // cfg.block_size

    # Prefix caching: no chunk crosses a prompt's last block boundary (the state there is saved).
    if cfg.checkpoints_prompt_blocks:
        for rid, s in slices.items():
            r = by_id[rid]
            last_boundary = (r.num_prompt_tokens - 1) // cfg.block_size * cfg.block_size
            assert not (r.num_computed_tokens < last_boundary < r.num_computed_tokens + s.num_tokens), (r, s)

    # 5. Decode first: an unscheduled, unpreempted decode means the decodes used up the step.
    live_decodes = [r for r in step.running if not r.is_prefill and r.request_id not in preempted]
    if any(r.request_id not in slices for r in live_decodes):
        assert prefill_tokens == 0
        assert decode_tokens == cfg.max_num_batched_tokens or len(plan.slices) == cfg.max_num_seqs

    # 8. Preemption order: decode victims are the back of the whole queue; prefill victims the back
    # of the running prefills.
    kept = [r for r in step.running if r.request_id not in preempted]
    for rid in preempted:
        victim = by_id[rid]
        rivals = kept if not victim.is_prefill else [r for r in kept if r.is_prefill]
        assert all(victim.queue_key >= r.queue_key for r in rivals), (rid, plan)

    # 3. Progress: pending prefill, a quantum of budget, a free slot and pages for one useful chunk
    # of some candidate -> some prefill advances.
    budget = plan.stats.prefill_budget_tokens
    unit = 1 if cfg.sub_block_exception and not micro else plan.quantum  # guarantee 3's "one quantum"
    pages_left = step.num_free_kv_pages + freed - pages
    candidates = [r for r in kept if r.is_prefill] + ([] if preempted else list(step.waiting))
    seats_left = cfg.max_num_seqs - (len(running_ids) - len(preempted)) - len(admitted)
    could_run = [
        r
        for r in candidates
        if rules.new_pages_needed(r.num_computed_tokens, smallest_useful_chunk(r, step), cfg.kv_page_size) <= pages_left
        and (r.request_id in running_ids or seats_left > 0)
    ]
    if could_run and budget >= unit and len(plan.slices) < cfg.max_num_seqs:
        assert prefill_tokens > 0, ("stall", plan)
    pending = [r for r in kept if r.is_prefill] + list(step.waiting)
    assert plan.stats.num_pending_prefills == len(pending)
    assert plan.stats.stalled == (bool(pending) and budget >= unit and prefill_tokens == 0)

    # 6. Work conserving: with a unit of budget left and pages to spare, no prefill could have
    # taken more (each is at its prompt end, threshold, or alignment cap).
    unit = plan.quantum if micro else 1
    leftover = budget - prefill_tokens
    if leftover >= unit and len(plan.slices) < cfg.max_num_seqs:
        for r in candidates:
            if r.request_id not in running_ids and (seats_left <= 0 or preempted):
                continue
            got = slices[r.request_id].num_tokens if r.request_id in slices else 0
            offer = min(got + leftover // unit * unit, r.num_prefill_tokens_left)
            if cfg.long_prefill_token_threshold:
                offer = min(offer, cfg.long_prefill_token_threshold)
            if cfg.is_aligned:
                offer = rules.align_chunk(
                    r.num_computed_tokens, offer, r.num_prompt_tokens, cfg.block_size, cfg.sub_block_exception
                )
            if cfg.checkpoints_prompt_blocks:
                offer = rules.stop_at_last_boundary(r.num_computed_tokens, offer, r.num_prompt_tokens, cfg.block_size)
            extra_pages = rules.new_pages_needed(
                r.num_computed_tokens, offer, cfg.kv_page_size
            ) - rules.new_pages_needed(r.num_computed_tokens, got, cfg.kv_page_size)
            if extra_pages <= pages_left:
                assert offer <= got, ("budget left unused", r, got, offer, plan)
