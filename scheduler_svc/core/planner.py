"""Plans one engine step from the worker's full scheduling state. Pure and deterministic.

Algorithm (docs/design.md, Planning rules):
1. Decodes first. Running decodes, in queue order (priority, then arrival), get one token each
   while the token and sequence budgets last. A decode that needs a KV page when none is free
   preempts the lowest-priority, latest-arrived running request (itself last) until the page fits.
   Prefills never take a page or a token from a running decode.
2. The prefill budget is what the decodes left. In a step that carries decodes, the prefills share
   a mixed-step cap (mixed_prefill_cap): max_num_prefill_tokens_per_step with micro-slicing on (the
   step is "micro-sliced"), the compute share's budget with a share mode on (core/share.py), or the
   smaller of the two. Every prefill of the step shares it: the step time the decodes wait on is
   every prefill token's. With micro_slice_long_prompts_only, only the prompts longer than the
   micro budget share it (rules.sliced_prompt_threshold), and the ones that fit in it are planned as
   plain chunked prefill plans them.
3. Micro-sliced: the sliced prompts' budget is split among their running prefills in whole quanta
   (rules.split_quanta); each share is capped by the prompt left, the long-prefill threshold and the
   free pages, then aligned (rules.align_chunk). Budget a share could not use is offered again, in
   quanta, in rotation order (work conserving). Then any other running prefills (long-prompts-only
   mode) take what is left of the step's budget first come first served, as plain chunked prefill
   does.
4. Waiting requests are admitted in queue order with what is left (a sliced prompt in whole quanta
   of the sliced budget left), within max_num_seqs, and not in a step that preempted.
5. Stall breaker: if running prefills are pending and none could start for lack of pages that other
   running prefills hold, the latest of those is preempted and the prefills are planned again.
6. Remedies: a plan that would still be empty while requests wait or run says what gives way
   instead (core/remedies.py): waiting requests' prefix-cache hits are dropped, from the back of
   the queue, until the step plans something; else the head pending prefill, which can never fit,
   fails. Steps 1-5 never read the pinned pages, so every plan they make is as it was without them.
7. Drafts (speculative decoding), last: each decode that got its token, in the order it got it, is
   granted up to num_draft_tokens more from what steps 1-5 left of the token budget and the free
   pages, within its generation limit and (ALIGN) its block (rules.draft_limit). They never preempt,
   delay or shrink anything planned before them; with no drafts asked the pass does not run.

In long-prompts-only mode with no prompt longer than the budget, every plan is plain chunked
prefill's.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import chain
from operator import attrgetter

from scheduler_svc.core import rules
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.plan import PlanStats, Slice, StepPlan
from scheduler_svc.core.remedies import remedy_plan
from scheduler_svc.core.share import mixed_prefill_cap
from scheduler_svc.core.state import RequestState, StepInput
from scheduler_svc.core.validation import validate_step

_QUEUE_ORDER = attrgetter("priority", "arrival_time")  # == RequestState.queue_key, without a call
_DRAFTS = attrgetter("num_draft_tokens")


@dataclass(slots=True)
class _Ledger:
    """What is left to hand out in this step."""

    tokens_left: int  # of max_num_batched_tokens
    seqs_left: int  # slices left of max_num_seqs
    seats_left: int  # running places left of max_num_seqs (for admissions)
    free_pages: int  # KV pages


@dataclass(slots=True)
class _Grant:
    """One request's slice while the plan is being built."""

    request: RequestState
    num_tokens: int = 0  # tokens granted so far
    num_pages: int = 0  # new pages those tokens take


def plan_step(step: StepInput) -> StepPlan:
    """Returns the plan of one step. Raises InvalidArgumentError on inconsistent input."""
    validate_step(step)
    plan = _plan_once(step)
    if plan.slices or plan.preempted_request_ids or not (step.running or step.waiting):
        return plan
    return remedy_plan(step, plan, _plan_once)


def _plan_once(step: StepInput) -> StepPlan:
    """Steps 1-5 of the algorithm on a valid input."""
    config = step.config
    quantum = config.quantum
    running = sorted(step.running, key=_QUEUE_ORDER)  # stable: worker order breaks ties
    ledger = _Ledger(
        tokens_left=config.max_num_batched_tokens,
        seqs_left=config.max_num_seqs,
        seats_left=config.max_num_seqs - len(running),
        free_pages=step.num_free_kv_pages,
    )
    preempted: list[RequestState] = []
    decodes = _schedule_decodes(running, config, ledger, preempted)
    micro_sliced = bool(decodes) and config.max_num_prefill_tokens_per_step > 0
    budget = ledger.tokens_left
    cap = mixed_prefill_cap(config, step.share, len(decodes))
    threshold = config.sliced_prompt_threshold
    preempted_ids = {r.request_id for r in preempted}
    prefills_running = [  # r.is_prefill, inlined: this runs over every running request every step
        r for r in running if r.num_computed_tokens < r.num_prompt_tokens and r.request_id not in preempted_ids
    ]
    sliced_only = cap is not None and all(  # every pending prompt shares the mixed budget
        r.num_prompt_tokens > threshold for r in chain(prefills_running, step.waiting)
    )
    unit = rules.progress_unit(quantum, sliced_only, config.sub_block_exception)
    while True:
        trial = replace(ledger)
        waiting = [] if preempted else sorted(step.waiting, key=_QUEUE_ORDER)
        prefills = _schedule_prefills(prefills_running, waiting, config, trial, budget, cap, step.step_index)
        if prefills or not _is_stuck_on_pages(prefills_running, config, trial, budget, unit):
            break
        victim = prefills_running.pop()  # lowest priority, latest arrival
        preempted.append(victim)
        ledger.free_pages += rules.pages_for_tokens(victim.num_computed_tokens, config.kv_page_size)
        ledger.seats_left += 1
    has_place = _has_place(prefills_running, step.waiting, trial, preempted)
    num_drafts = _grant_drafts(decodes, config, trial) if decodes and any(map(_DRAFTS, step.running)) else 0
    grants = decodes + prefills
    return StepPlan(
        slices=_to_slices(grants, config),
        preempted_request_ids=tuple(r.request_id for r in preempted),
        quantum=quantum,
        stats=_stats(
            decodes,
            prefills,
            prefills_running,
            step,
            budget if cap is None or threshold else min(budget, cap),
            micro_sliced,
            unit,
            has_place,
            num_drafts,
        ),
    )


def _schedule_decodes(
    running: list[RequestState], config: SchedulerConfig, ledger: _Ledger, preempted: list[RequestState]
) -> list[_Grant]:
    """One token per running decode, preempting from the back of the queue when pages run out."""
    granted: dict[str, _Grant] = {}
    active = list(running)  # not preempted, queue order
    preempted_ids: set[str] = set()
    page = config.kv_page_size
    # The ledger's counters live in locals through the loop (this runs for every decode every step).
    tokens_left, seqs_left, free_pages = ledger.tokens_left, ledger.seqs_left, ledger.free_pages
    for request in running:
        computed = request.num_computed_tokens
        if computed < request.num_prompt_tokens or request.request_id in preempted_ids:
            continue  # a prefill, or already preempted
        if tokens_left < 1 or seqs_left < 1:
            break
        need = 1 if computed % page == 0 else 0  # == rules.new_pages_needed(computed, 1, page)
        while need > free_pages:
            victim = active.pop()
            preempted.append(victim)
            preempted_ids.add(victim.request_id)
            free_pages += rules.pages_for_tokens(victim.num_computed_tokens, page)
            ledger.seats_left += 1
            undone = granted.pop(victim.request_id, None)
            if undone is not None:
                free_pages += undone.num_pages
                tokens_left += undone.num_tokens
                seqs_left += 1
            if victim is request:
                break
        if request.request_id in preempted_ids:
            break  # it preempted itself: nothing behind it is left either
        free_pages -= need
        tokens_left -= 1
        seqs_left -= 1
        granted[request.request_id] = _Grant(request, 1, need)
    ledger.tokens_left, ledger.seqs_left, ledger.free_pages = tokens_left, seqs_left, free_pages
    return list(granted.values())


def _grant_drafts(decodes: list[_Grant], config: SchedulerConfig, ledger: _Ledger) -> int:
    """Step 7: adds draft tokens to the decode grants, in grant order, from the ledger's leftover
    tokens and free pages (never more than each asks, rules.draft_limit); returns how many."""
    page = config.kv_page_size
    grid = config.block_size if config.is_aligned else 0
    granted = 0
    for grant in decodes:
        r = grant.request
        if ledger.tokens_left <= 0:
            break
        computed = r.num_computed_tokens
        pages_held = ledger.free_pages + grant.num_pages  # its decode's new page, if any, is its own
        drafts = min(
            r.num_draft_tokens,
            ledger.tokens_left,
            rules.draft_limit(computed, r.num_output_tokens, r.max_tokens, grid),
            rules.max_tokens_for_pages(computed, pages_held, page) - grant.num_tokens,
        )
        if drafts <= 0:
            continue
        pages = rules.new_pages_needed(computed, grant.num_tokens + drafts, page)
        ledger.free_pages -= pages - grant.num_pages
        ledger.tokens_left -= drafts
        grant.num_tokens, grant.num_pages = grant.num_tokens + drafts, pages
        granted += drafts
    return granted


def _schedule_prefills(
    running: list[RequestState],
    waiting: list[RequestState],
    config: SchedulerConfig,
    ledger: _Ledger,
    budget: int,
    cap: int | None,
    step_index: int,
) -> list[_Grant]:
    """Grants of running prefills, then admissions of waiting requests, within `budget` tokens.
    With a mixed-step cap (mixed_prefill_cap), the sliced prompts (every prompt, or in
    long-prompts-only mode those longer than the micro budget) share at most `cap` of those tokens,
    split in quanta; any others are planned as plain chunked prefill plans them."""
    grants = [_Grant(r) for r in running]
    quantum = config.quantum
    threshold = config.sliced_prompt_threshold
    sliced_left = budget if cap is None else min(budget, cap)  # what the sliced prompts may still take
    plain = grants
    if cap is not None:
        sliced = [g for g in grants if g.request.num_prompt_tokens > threshold]
        if sliced:
            plain = [g for g in grants if g.request.num_prompt_tokens <= threshold]
            took = _share_in_quanta(sliced, sliced_left, quantum, config, ledger, step_index)
            budget -= took
            sliced_left -= took
    for grant in plain:
        budget -= _grow(grant, budget, config, ledger)
    for request in waiting:
        if budget <= 0 or ledger.seats_left <= 0:
            break
        is_sliced = cap is not None and request.num_prompt_tokens > threshold
        grant = _Grant(request)
        offer = _admission_offer(grant, budget, sliced_left, quantum, is_sliced)
        while offer > 0 and (took := _grow(grant, offer, config, ledger)):  # re-offer what alignment left
            budget -= took
            if is_sliced:
                sliced_left -= took
            offer = _admission_offer(grant, budget, sliced_left, quantum, is_sliced)
        if grant.num_tokens:
            ledger.seats_left -= 1
            grants.append(grant)
    return [g for g in grants if g.num_tokens > 0]


def _admission_offer(grant: _Grant, budget: int, sliced_left: int, quantum: int, is_sliced: bool) -> int:
    """A waiting prompt's offer: the step's budget left, or a sliced one's share of the cap left in
    quanta (its whole rest when that fits, rules.quanta_offer)."""
    if not is_sliced:
        return budget
    rest = grant.request.num_prefill_tokens_left - grant.num_tokens
    return rules.quanta_offer(min(budget, sliced_left), quantum, rest)


def _share_in_quanta(
    grants: list[_Grant], budget: int, quantum: int, config: SchedulerConfig, ledger: _Ledger, step_index: int
) -> int:
    """Splits `budget` among the grants in whole quanta, remainder quanta rotating with the step
    index, then offers what alignment left unused again, in quanta, in rotation order, and what is
    left below a quantum to the prompts it finishes (work conserving, rules.quanta_offer). Returns
    the tokens taken."""
    num_quanta = budget // quantum
    shares = rules.split_quanta(num_quanta, len(grants), step_index)
    order = rules.rotation_order(len(grants), num_quanta, step_index)
    left = budget
    for index in order:
        left -= _grow(grants[index], shares[index] * quantum, config, ledger)
    taken = left
    while taken and left >= quantum:
        taken = 0
        for index in order:
            took = _grow(grants[index], left // quantum * quantum, config, ledger)
            left -= took
            taken += took
    for index in order:  # what is left below a quantum finishes the prompts whose rest fits in it
        grant = grants[index]
        rest = grant.request.num_prefill_tokens_left - grant.num_tokens
        if 0 < rest <= left:
            left -= _grow(grant, rest, config, ledger)
    return budget - left


def _grow(grant: _Grant, offer: int, config: SchedulerConfig, ledger: _Ledger) -> int:
    """Adds up to `offer` tokens to a prefill grant within every cap; returns the tokens taken."""
    request = grant.request
    if offer <= 0 or (grant.num_tokens == 0 and ledger.seqs_left <= 0):
        return 0
    total = min(grant.num_tokens + offer, request.num_prefill_tokens_left, ledger.tokens_left + grant.num_tokens)
    if config.long_prefill_token_threshold > 0:
        total = min(total, config.long_prefill_token_threshold)
    pages_available = ledger.free_pages + grant.num_pages
    total = min(total, rules.max_tokens_for_pages(request.num_computed_tokens, pages_available, config.kv_page_size))
    if config.is_aligned:
        total = rules.align_chunk(
            request.num_computed_tokens,
            total,
            request.num_prompt_tokens,
            config.block_size,
            config.sub_block_exception,
        )
    if config.checkpoints_prompt_blocks:
        total = rules.stop_at_last_boundary(
            request.num_computed_tokens, total, request.num_prompt_tokens, config.block_size
        )
    if total <= grant.num_tokens:
        return 0
    pages = rules.new_pages_needed(request.num_computed_tokens, total, config.kv_page_size)
    took = total - grant.num_tokens
    if grant.num_tokens == 0:
        ledger.seqs_left -= 1
    ledger.free_pages -= pages - grant.num_pages
    ledger.tokens_left -= took
    grant.num_tokens, grant.num_pages = total, pages
    return took


def _is_stuck_on_pages(
    running_prefills: list[RequestState], config: SchedulerConfig, ledger: _Ledger, budget: int, unit: int
) -> bool:
    """True when the head running prefill could advance with the pages that the running prefills
    behind it hold, but not with the free pages: the case where prefills would wait on each other
    forever."""
    if len(running_prefills) < 2 or budget < unit or ledger.seqs_left < 1:
        return False
    head = running_prefills[0]
    chunk = rules.smallest_useful_chunk(
        head.num_computed_tokens, head.num_prompt_tokens, config.block_size, config.is_aligned,
        config.sub_block_exception,
    )  # fmt: skip
    if chunk > budget:
        return False
    need = rules.new_pages_needed(head.num_computed_tokens, chunk, config.kv_page_size)
    held_behind = sum(rules.pages_for_tokens(r.num_computed_tokens, config.kv_page_size) for r in running_prefills[1:])
    return ledger.free_pages < need <= ledger.free_pages + held_behind


def _to_slices(grants: list[_Grant], config: SchedulerConfig) -> tuple[Slice, ...]:
    grid = config.block_size if config.is_aligned else 0
    # tuple.__new__(Slice, fields) is Slice(*fields) without the NamedTuple's Python constructor: a
    # third of the planner's time at 256 decodes went to that call.
    new = tuple.__new__
    return tuple([
        new(Slice, (
            (r := g.request).request_id,
            g.num_tokens,
            (computed := r.num_computed_tokens) < r.num_prompt_tokens,
            grid > 0 and (computed + g.num_tokens) % grid == 0,
        ))
        for g in grants
    ])  # fmt: skip


def _has_place(
    running_prefills: list[RequestState],
    waiting: tuple[RequestState, ...],
    ledger: _Ledger,
    preempted: list[RequestState],
) -> bool:
    """Whether some pending prefill had a place in the step: a slice left (max_num_seqs) for a
    running prefill, or also a running place for a waiting one in a step that preempted nothing."""
    if ledger.seqs_left <= 0:
        return False
    return bool(running_prefills) or (bool(waiting) and ledger.seats_left > 0 and not preempted)


def _stats(
    decodes: list[_Grant],
    prefills: list[_Grant],
    running_prefills: list[RequestState],
    step: StepInput,
    budget: int,
    micro_sliced: bool,
    unit: int,
    has_place: bool,
    num_drafts: int,
) -> PlanStats:
    num_pending = len(running_prefills) + len(step.waiting)
    # A stall: some pending prefill had a place in the step, the budget held a quantum, and nothing
    # was prefilled. Requests waiting for a seat while max_num_seqs requests decode are queued, not
    # stalled.
    return PlanStats(
        num_decode_tokens=sum(g.num_tokens for g in decodes),
        num_prefill_tokens=sum(g.num_tokens for g in prefills),
        prefill_budget_tokens=budget,
        num_pending_prefills=num_pending,
        stalled=has_place and budget >= unit and not prefills,
        micro_sliced=micro_sliced,
        num_kv_pages_allocated=sum(g.num_pages for g in decodes + prefills),
        num_draft_tokens=num_drafts,
    )
