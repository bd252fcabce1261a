"""Checks of the planning guarantees (docs/design.md) on one (input, plan) pair, written from the guarantees, not
from the planner's code: they recompute caps from the request states and the rule functions."""

from __future__ import annotations

from dataclasses import dataclass, replace

from scheduler_svc.core import RequestState, Slice, StepInput, StepPlan, rules
from scheduler_svc.core.share import mixed_prefill_cap


def smallest_useful_chunk(r: RequestState, step: StepInput) -> int:
    """The fewest tokens a prefill could be granted and still advance."""
    cfg = step.config
    left = r.num_prefill_tokens_left
    if not cfg.is_aligned or cfg.sub_block_exception:
        return 1
    next_boundary = (r.num_computed_tokens // cfg.block_size + 1) * cfg.block_size
    return min(left, next_boundary - r.num_computed_tokens)


@dataclass
class Facts:
    """What the checks share, computed once from the input and the plan."""

    step: StepInput
    plan: StepPlan
    by_id: dict[str, RequestState]
    running_ids: set[str]
    preempted: set[str]
    slices: dict[str, Slice]
    prefill_tokens: int
    decode_tokens: int
    admitted: list[str]
    kept: list[RequestState]  # running and not preempted
    micro: bool  # the step was micro-sliced
    cap: int | None  # the mixed-step prefill cap (micro-slicing's, the compute share's); None: none
    freed_pages: int  # by preemption
    pages: int  # taken by the plan

    @property
    def pages_left(self) -> int:
        return self.step.num_free_kv_pages + self.freed_pages - self.pages

    def is_sliced(self, r: RequestState) -> bool:
        """A prompt that shares the mixed-step cap, in a step with one: every prompt, or with
        micro_slice_long_prompts_only a prompt longer than the micro budget."""
        cfg = self.step.config
        return self.cap is not None and (
            not cfg.micro_slice_long_prompts_only or r.num_prompt_tokens > cfg.max_num_prefill_tokens_per_step
        )

    @property
    def sliced_prefill_tokens(self) -> int:
        return sum(s.num_tokens for rid, s in self.slices.items() if s.is_prefill and self.is_sliced(self.by_id[rid]))

    @property
    def seats_left(self) -> int:
        cfg = self.step.config
        return cfg.max_num_seqs - (len(self.running_ids) - len(self.preempted)) - len(self.admitted)

    @property
    def candidates(self) -> list[RequestState]:
        """Prefills that could have been given tokens this step."""
        return [r for r in self.kept if r.is_prefill] + ([] if self.preempted else list(self.step.waiting))


def facts_of(step: StepInput, plan: StepPlan) -> Facts:
    cfg = step.config
    by_id = {r.request_id: r for r in step.running + step.waiting}
    running_ids = {r.request_id for r in step.running}
    preempted = set(plan.preempted_request_ids)
    slices = {s.request_id: s for s in plan.slices}
    decode_tokens = sum(s.num_tokens for s in plan.slices if not s.is_prefill)
    return Facts(
        step=step,
        plan=plan,
        by_id=by_id,
        running_ids=running_ids,
        preempted=preempted,
        slices=slices,
        prefill_tokens=sum(s.num_tokens for s in plan.slices if s.is_prefill),
        decode_tokens=decode_tokens,
        admitted=[rid for rid in slices if rid not in running_ids],
        kept=[r for r in step.running if r.request_id not in preempted],
        micro=decode_tokens > 0 and cfg.max_num_prefill_tokens_per_step > 0,
        cap=mixed_prefill_cap(cfg, step.share, sum(1 for s in plan.slices if not s.is_prefill)),
        freed_pages=sum(rules.pages_for_tokens(by_id[rid].num_computed_tokens, cfg.kv_page_size) for rid in preempted),
        pages=sum(
            rules.new_pages_needed(by_id[rid].num_computed_tokens, s.num_tokens, cfg.kv_page_size)
            for rid, s in slices.items()
        ),
    )


def after_drops(step: StepInput, dropped: tuple[str, ...]) -> StepInput:
    """The step as the plan sees it once its dropped hits are given up: those waiting requests have
    nothing computed, and the pages they pinned are free."""
    pinned = {p.request_id: p.num_kv_pages for p in step.pinned_kv_pages}
    gone = set(dropped)
    return replace(
        step,
        waiting=tuple(r._replace(num_computed_tokens=0) if r.request_id in gone else r for r in step.waiting),
        num_free_kv_pages=step.num_free_kv_pages + sum(pinned.get(rid, 0) for rid in gone),
        pinned_kv_pages=tuple(p for p in step.pinned_kv_pages if p.request_id not in gone),
    )


def pages_short(step: StepInput, r: RequestState) -> int:
    """Pages r's smallest useful chunk lacks beyond the free pages and every page the other running
    requests hold (> 0: it can never fit in this pool)."""
    cfg = step.config
    need = rules.new_pages_needed(r.num_computed_tokens, smallest_useful_chunk(r, step), cfg.kv_page_size)
    others = sum(
        rules.pages_for_tokens(o.num_computed_tokens, cfg.kv_page_size)
        for o in step.running
        if o.request_id != r.request_id
    )
    return need - step.num_free_kv_pages - others


def check_remedies(step: StepInput, plan: StepPlan) -> StepInput:
    """9. Remedies: live work never gets an empty plan. Dropped hits are waiting requests' hits, each
    the back of the queue among the hits not dropped before it; a failed request is the only
    change of its plan, made only when no waiting request holds a hit, and it can never fit. Returns the step after the
    drops, which the plan is a plan of."""
    if step.running or step.waiting:
        assert plan.slices or plan.preempted_request_ids or plan.dropped_prefix_request_ids or plan.failed_request_ids
    hits = [r for r in step.waiting if r.num_computed_tokens > 0]
    left = {r.request_id: r for r in hits}
    for rid in plan.dropped_prefix_request_ids:
        victim = left.pop(rid)  # a hit, dropped once
        assert all(victim.queue_key >= r.queue_key for r in left.values()), ("not the latest hit", rid, plan)
    after = after_drops(step, plan.dropped_prefix_request_ids)
    if plan.failed_request_ids:
        assert len(plan.failed_request_ids) == 1 and not plan.slices and not plan.preempted_request_ids
        assert not hits, "a plan fails nothing while a waiting request holds a hit"
        by_id = {r.request_id: r for r in after.running + after.waiting}
        failed = by_id[plan.failed_request_ids[0]]
        assert failed.is_prefill and pages_short(after, failed) > 0, ("fails but could fit", failed, plan)
    return after


def check_plan(step: StepInput, plan: StepPlan) -> None:
    step = check_remedies(step, plan)  # 9
    f = facts_of(step, plan)
    check_shape(f)
    check_limits(f)  # 1
    check_alignment(f)  # 2
    check_progress(f)  # 3
    check_decode_first(f)  # 5
    check_work_conserving(f)  # 6
    check_preemption_order(f)  # 8


def check_shape(f: Facts) -> None:
    """Each request once, known, positive, not both preempted and scheduled; no admission in a step
    that preempts."""
    cfg = f.step.config
    assert len(f.slices) == len(f.plan.slices)
    assert f.preempted <= f.running_ids and not (f.preempted & f.slices.keys())
    for s in f.plan.slices:
        r = f.by_id[s.request_id]
        assert s.num_tokens > 0 and s.is_prefill == r.is_prefill
        if r.is_prefill:
            assert s.num_tokens <= r.num_prefill_tokens_left
            if cfg.long_prefill_token_threshold:
                assert s.num_tokens <= cfg.long_prefill_token_threshold
        else:
            assert s.num_tokens == 1 and r.request_id in f.running_ids
        end = r.num_computed_tokens + s.num_tokens
        assert s.ends_on_checkpoint == (cfg.is_aligned and end % cfg.block_size == 0)
    if f.preempted:
        assert not f.admitted, "no admission in a step that preempts"


def check_limits(f: Facts) -> None:
    """1. Never exceed the token budget, max_num_seqs, the micro-slicing budget, or the pages."""
    cfg = f.step.config
    assert f.prefill_tokens + f.decode_tokens <= cfg.max_num_batched_tokens
    assert len(f.plan.slices) <= cfg.max_num_seqs
    assert len(f.running_ids) - len(f.preempted) + len(f.admitted) <= cfg.max_num_seqs
    assert f.plan.stats.micro_sliced == f.micro
    if f.micro and not cfg.micro_slice_long_prompts_only:  # every prefill token of the step counts
        assert f.prefill_tokens <= cfg.max_num_prefill_tokens_per_step
    if f.micro:  # long-prompts-only: the prompts longer than the budget share it, the others are not capped
        assert f.sliced_prefill_tokens <= cfg.max_num_prefill_tokens_per_step
    if f.cap is not None:  # the compute share's budget too, where it is on
        assert f.sliced_prefill_tokens <= f.cap
    left_after_decodes = cfg.max_num_batched_tokens - f.decode_tokens
    whole = f.cap is None or cfg.sliced_prompt_threshold > 0  # no cap, or one that caps only long prompts
    assert f.plan.stats.prefill_budget_tokens == (left_after_decodes if whole else min(left_after_decodes, f.cap))
    assert f.pages == f.plan.stats.num_kv_pages_allocated
    assert f.pages <= f.step.num_free_kv_pages + f.freed_pages


def check_alignment(f: Facts) -> None:
    """2. Non-final chunks end on the grid, or (sub-block exception) cross no boundary; with prefix
    caching no chunk crosses a prompt's last boundary (the state there is saved)."""
    cfg = f.step.config
    for rid, s in f.slices.items():
        r = f.by_id[rid]
        start, end = r.num_computed_tokens, r.num_computed_tokens + s.num_tokens
        if cfg.is_aligned and s.is_prefill and end < r.num_prompt_tokens and end % cfg.block_size:
            assert cfg.sub_block_exception
            assert end // cfg.block_size == start // cfg.block_size
        if cfg.checkpoints_prompt_blocks:
            last_boundary = (r.num_prompt_tokens - 1) // cfg.block_size * cfg.block_size
            assert not (start < last_boundary < end), (r, s)


def check_progress(f: Facts) -> None:
    """3. Pending prefill, a quantum of budget, a free slot and pages for one useful chunk of some
    candidate -> some prefill advances. Also what PlanStats says about it."""
    cfg, plan = f.step.config, f.plan
    budget = plan.stats.prefill_budget_tokens

    def unit(r: RequestState) -> int:
        """Guarantee 3's "one quantum": a prompt that shares the micro budget advances in quanta;
        any other one under the sub-block exception with any budget, as in plain chunked prefill."""
        return 1 if cfg.sub_block_exception and not f.is_sliced(r) else plan.quantum

    pages_left, seats_left = f.pages_left, f.seats_left
    could_run = [
        r
        for r in f.candidates
        if rules.new_pages_needed(r.num_computed_tokens, smallest_useful_chunk(r, f.step), cfg.kv_page_size)
        <= pages_left
        and (r.request_id in f.running_ids or seats_left > 0)
        and budget >= unit(r)
    ]
    if could_run and len(plan.slices) < cfg.max_num_seqs:
        assert f.prefill_tokens > 0, ("stall", plan)
    running_prefills = [r for r in f.kept if r.is_prefill]
    pending = running_prefills + list(f.step.waiting)
    assert plan.stats.num_pending_prefills == len(pending)
    # Stalled: a pending prefill had a place (a slice left; for a waiting one also a seat, and no
    # preemption), a quantum of budget, and no prefill token. Waiting for a seat is not a stall.
    has_place = len(plan.slices) < cfg.max_num_seqs and (
        bool(running_prefills) or (bool(f.step.waiting) and seats_left > 0 and not f.preempted)
    )
    least_unit = min((unit(r) for r in pending), default=plan.quantum)
    assert plan.stats.stalled == (has_place and budget >= least_unit and f.prefill_tokens == 0)


def check_decode_first(f: Facts) -> None:
    """5. An unscheduled, unpreempted decode means the decodes used up the step."""
    cfg = f.step.config
    live_decodes = [r for r in f.kept if not r.is_prefill]
    if any(r.request_id not in f.slices for r in live_decodes):
        assert f.prefill_tokens == 0
        assert f.decode_tokens == cfg.max_num_batched_tokens or len(f.plan.slices) == cfg.max_num_seqs


def check_work_conserving(f: Facts) -> None:
    """6. With a unit of budget left and pages to spare, no prefill could have taken more (each is
    at its prompt end, threshold, or alignment cap)."""
    cfg = f.step.config
    leftover = f.plan.stats.prefill_budget_tokens - f.prefill_tokens
    sliced_leftover = leftover if f.cap is None else min(leftover, f.cap - f.sliced_prefill_tokens)
    if leftover < 1 or len(f.plan.slices) >= cfg.max_num_seqs:
        return
    pages_left, seats_left = f.pages_left, f.seats_left
    for r in f.candidates:
        if r.request_id not in f.running_ids and (seats_left <= 0 or f.preempted):
            continue
        got = f.slices[r.request_id].num_tokens if r.request_id in f.slices else 0
        # A sliced prompt is offered its share of the micro budget in quanta; any other prompt the
        # step's budget, token by token, as plain chunked prefill offers it.
        if f.is_sliced(r):  # whole quanta, or the prompt's whole rest where that fits
            offer = got + rules.quanta_offer(sliced_leftover, f.plan.quantum, r.num_prefill_tokens_left - got)
        else:
            offer = got + leftover
        offer = min(offer, r.num_prefill_tokens_left)
        if cfg.long_prefill_token_threshold:
            offer = min(offer, cfg.long_prefill_token_threshold)
        if cfg.is_aligned:
            offer = rules.align_chunk(
                r.num_computed_tokens, offer, r.num_prompt_tokens, cfg.block_size, cfg.sub_block_exception
            )
        if cfg.checkpoints_prompt_blocks:
            offer = rules.stop_at_last_boundary(r.num_computed_tokens, offer, r.num_prompt_tokens, cfg.block_size)
        extra_pages = rules.new_pages_needed(r.num_computed_tokens, offer, cfg.kv_page_size) - rules.new_pages_needed(
            r.num_computed_tokens, got, cfg.kv_page_size
        )
        if extra_pages <= pages_left:
            assert offer <= got, ("budget left unused", r, got, offer, f.plan)


def check_preemption_order(f: Facts) -> None:
    """8. Decode victims are the back of the whole queue; prefill victims the back of the running
    prefills."""
    for rid in f.preempted:
        victim = f.by_id[rid]
        rivals = f.kept if not victim.is_prefill else [r for r in f.kept if r.is_prefill]
        assert all(victim.queue_key >= r.queue_key for r in rivals), (rid, f.plan)
