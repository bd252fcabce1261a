"""The steady-decode step, planned from columns: the common step of a busy worker, where every
running request decodes, none waits, and the free KV pages cover every decode's new page.

plan_step (planner.py) then grants one token to each running request in queue order and nothing
else: no preemption (the pages suffice), no prefill (none is pending), no admission (none waits),
no draft token (a step where some decode has drafts is left to plan_step).
This module computes that same plan, byte for byte, from the request columns of the wire form
without a RequestState per request: every per-request operation is a C-level `map` over whole
columns (about a fifth of the general path's Python at 256 decodes). Any other step, and any input
the checks here do not pass, returns None, and the caller runs plan_step, which plans it or names
what is wrong (so errors read the same on both paths).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import repeat
from operator import add, eq, ge, le, mod, sub
from typing import NamedTuple

from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.plan import PlanStats, Slice, StepPlan
from scheduler_svc.core.share import ShareState, mixed_prefill_cap


class StateColumns(NamedTuple):
    """One queue's request states as columns, in RequestState's field order; entry i of every
    column is request i."""

    request_id: Sequence[str]
    num_prompt_tokens: Sequence[int]
    num_computed_tokens: Sequence[int]
    num_output_tokens: Sequence[int]
    max_tokens: Sequence[int]
    priority: Sequence[int]
    arrival_time: Sequence[float]
    num_draft_tokens: Sequence[int] = ()  # empty: all 0


def plan_steady_decodes(
    config: SchedulerConfig,
    running: StateColumns,
    num_waiting: int,
    step_index: int,
    num_free_kv_pages: int,
    share: ShareState | None = None,
) -> StepPlan | None:
    """plan_step's plan when the step is a steady decode step and the input is valid; else None."""
    quantum = config.validate().quantum  # raises on an invalid config, as plan_step does first
    ids = running.request_id
    n = len(ids)
    if n == 0 or num_waiting or step_index < 0 or num_free_kv_pages < 0 or any(running.num_draft_tokens):
        return None  # drafts (or nothing to decode): plan_step's draft pass
    if share is not None:
        share.validate()  # raises as plan_step would, whose next check it is
    if n > config.max_num_seqs or n > config.max_num_batched_tokens:
        return None  # not every decode fits the step: plan_step picks which (or rejects the input)
    computed = running.num_computed_tokens
    if not _are_valid_decodes(running, n):
        return None
    page = config.kv_page_size
    num_pages = sum(map(eq, map(mod, computed, repeat(page)), repeat(0)))  # decodes starting a new page
    if num_pages > num_free_kv_pages:
        return None  # some decode preempts another: plan_step's loop
    order = _queue_order(running.priority, running.arrival_time, n)
    if order is not None:
        ids, computed = [ids[i] for i in order], [computed[i] for i in order]
    grid = config.block_size if config.is_aligned else 0
    # The decode of position `computed` ends at computed + 1: a checkpoint where that is on the grid.
    on_grid = map(eq, map(mod, map(add, computed, repeat(1)), repeat(grid)), repeat(0)) if grid > 0 else None
    ends = list(on_grid) if on_grid is not None else [False] * n
    # Slice(id, 1, False, ends) per decode, through tuple.__new__ (see planner._to_slices).
    slices = tuple(map(tuple.__new__, repeat(Slice), zip(ids, repeat(1), repeat(False), ends)))
    micro_sliced = config.max_num_prefill_tokens_per_step > 0
    budget = config.max_num_batched_tokens - n
    cap = mixed_prefill_cap(config, share, n)
    if cap is not None and not config.sliced_prompt_threshold:  # the cap bounds every prefill
        budget = min(budget, cap)
    stats = PlanStats(
        num_decode_tokens=n,
        num_prefill_tokens=0,
        prefill_budget_tokens=budget,
        num_pending_prefills=0,
        stalled=False,
        micro_sliced=micro_sliced,
        num_kv_pages_allocated=num_pages,
    )
    return StepPlan(slices=slices, preempted_request_ids=(), quantum=quantum, stats=stats)


def _are_valid_decodes(c: StateColumns, n: int) -> bool:
    """Every column has n entries and every request is a valid running decode (validation.py's
    _is_running_ok with computed >= prompt), ids non-empty and unique."""
    if any(len(column) != n for column in c[:-1]) or len(c.num_draft_tokens) not in (0, n):
        return False
    prompt, computed, outputs, max_tokens = (
        c.num_prompt_tokens,
        c.num_computed_tokens,
        c.num_output_tokens,
        c.max_tokens,
    )
    if min(prompt) < 1 or min(outputs) < 0 or min(max_tokens) < 1:
        return False
    if not all(map(ge, max_tokens, outputs)):
        return False
    # A decode: computed == prompt + outputs - 1 (so computed >= prompt, as outputs >= 1).
    if not all(map(eq, computed, map(sub, map(add, prompt, outputs), repeat(1)))) or min(outputs) < 1:
        return False
    if not all(c.request_id) or len(set(c.request_id)) != n:
        return False
    return all(map(math.isfinite, c.arrival_time))


def _queue_order(priority: Sequence[int], arrival: Sequence[float], n: int) -> list[int] | None:
    """Indices in queue order (priority, then arrival; ties in worker order, as planner's stable
    sort); None when the columns already are in that order (the usual case: admission order)."""
    if min(priority) == max(priority) and all(map(le, arrival, arrival[1:])):
        return None
    keys = list(zip(priority, arrival, strict=True))
    return sorted(range(n), key=keys.__getitem__)
