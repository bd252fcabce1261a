"""The remedies: what a plan says when nothing else can progress. Pure, like the planner.

A plan is empty, though requests wait or run, when no pending prefill can get a useful chunk from
the free pages (running decodes always get their token or preempt, planner.py). The pages it lacks
are then held where the planner's other rules cannot reach:

- a waiting request's prefix-cache hit holds its pages until admission (StepInput.pinned_kv_pages
  counts what giving each hit up would make reclaimable);
- the pending prefill itself, with whatever it already holds, needs more than the whole pool has.

An empty plan would be repeated as is, step after step, so the planner never returns one with live
work. In this order, each rule only when the ones before it left the plan empty:

1. drop_prefixes: the latest waiting request holding a hit (the back of the queue, so the head
   keeps what it holds) gives it up: it waits on with no computed tokens, its pinned pages count as
   free, and the step is planned again; repeated while the plan stays empty and hits are left.
   A plan that drops hits fails nothing, even if it plans nothing else: pages that several hits
   share are counted in none (StepInput.pinned_kv_pages), so only the next step's free pages tell
   what the drops gave back.
2. never_fits: with no hit left, the head pending prefill (of the running ones, else of the
   waiting ones) fails with RESOURCE_EXHAUSTED. It can never fit: see `never_fits`.

Preemption needs no remedy of its own: the planner's stall breaker preempts a running prefill
whenever that lets the head one advance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from operator import attrgetter

from scheduler_svc.core.plan import StepPlan
from scheduler_svc.core.state import RequestState, StepInput

PlanOnce = Callable[[StepInput], StepPlan]
_QUEUE_ORDER = attrgetter("priority", "arrival_time")


def is_empty(plan: StepPlan) -> bool:
    """Whether the plan changes nothing: no slice, no preemption, no remedy."""
    return not (plan.slices or plan.preempted_request_ids or plan.dropped_prefix_request_ids or plan.failed_request_ids)


def remedy_plan(step: StepInput, empty: StepPlan, plan_once: PlanOnce) -> StepPlan:
    """The plan of a step whose rules planned nothing (`empty`, planned from `step`) although
    requests wait or run: the remedies above, then whatever the step can plan after them."""
    if any(r.num_computed_tokens > 0 for r in step.waiting):
        _, plan, dropped = drop_prefixes(step, empty, plan_once)
        return replace(plan, dropped_prefix_request_ids=dropped)
    return replace(empty, failed_request_ids=(never_fits(step).request_id,))


def drop_prefixes(step: StepInput, plan: StepPlan, plan_once: PlanOnce) -> tuple[StepInput, StepPlan, tuple[str, ...]]:
    """Rule 1: gives up hits from the back of the waiting queue until the step plans something or no
    hit is left. Returns the step as it is after the drops, its plan and the dropped ids in order.

    Why the pages a hit pins count as free once it is dropped: the worker applies the drops before
    anything else of the plan, and what a dropped hit pinned alone is then unused cache, which the
    allocator evicts when a request needs the pages."""
    hits = sorted((r for r in step.waiting if r.num_computed_tokens > 0), key=_QUEUE_ORDER)
    dropped: list[str] = []
    while hits and is_empty(plan):
        victim = hits.pop()  # lowest priority, latest arrival
        dropped.append(victim.request_id)
        step = without_hit(step, victim)
        plan = plan_once(step)
    return step, plan, tuple(dropped)


def without_hit(step: StepInput, victim: RequestState) -> StepInput:
    """The step once `victim` (waiting) gave up its hit: nothing computed, its pinned pages free."""
    pinned = {p.request_id: p.num_kv_pages for p in step.pinned_kv_pages}
    rid = victim.request_id
    return replace(
        step,
        waiting=tuple(r._replace(num_computed_tokens=0) if r.request_id == rid else r for r in step.waiting),
        num_free_kv_pages=step.num_free_kv_pages + pinned.get(rid, 0),
        pinned_kv_pages=tuple(p for p in step.pinned_kv_pages if p.request_id != rid),
    )


def never_fits(step: StepInput) -> RequestState:
    """Rule 2: the request to fail when the step plans nothing and holds no hit: the head of the
    running prefills (queue order), else the head of the waiting requests.

    Why it can never fit. With no decode running, the step's whole token budget is offered to the
    prefills in queue order, and a budget of max_num_batched_tokens holds one useful chunk of any
    prefill (a block, or one token under the sub-block exception). So the head was refused for
    pages: its useful chunk needs more than the free pages, and (else the stall breaker would have
    preempted them) more than the free pages and every page the running prefills behind it hold. No
    other request holds a page: no decode runs and no waiting request holds a hit. The worker counts
    unused cache pages as free whenever one step could take more pages than are free outright, so
    that is the whole pool but for what the head holds itself. A head that waits holds nothing: the
    free pages are all there is for it.
    tests/scheduler/invariants.py checks the claim on every plan that fails a request."""
    running = sorted((r for r in step.running if r.num_computed_tokens < r.num_prompt_tokens), key=_QUEUE_ORDER)
    if running:
        return running[0]
    return min(step.waiting, key=_QUEUE_ORDER)
