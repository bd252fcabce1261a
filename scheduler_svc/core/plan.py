"""What the planner returns: the step plan, frozen."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


class Slice(NamedTuple):
    """One request's part of a step. A NamedTuple, immutable like the frozen dataclasses here: one
    is built per request per step on both sides of the wire, and a frozen dataclass costs two
    to four times as much to construct."""

    request_id: str
    num_tokens: int  # computes [num_computed_tokens, num_computed_tokens + num_tokens)
    is_prefill: bool  # False: a decode of 1 + its granted draft tokens
    ends_on_checkpoint: bool  # the end is on the block grid in ALIGN mode: save the Mamba state


@dataclass(frozen=True, slots=True)
class PlanStats:
    num_decode_tokens: int  # tokens of decode slices (their draft tokens included)
    num_prefill_tokens: int  # tokens of prefill slices
    prefill_budget_tokens: int  # tokens prefills could use after decodes (long prompts: at most the micro budget)
    num_pending_prefills: int  # running prefills plus waiting requests
    stalled: bool  # prefills pending, budget >= one quantum, none scheduled
    micro_sliced: bool  # long prompts shared the micro budget in quanta (mixed step, budget set)
    num_kv_pages_allocated: int  # pages the plan takes from the free pool
    num_draft_tokens: int = 0  # draft tokens granted to decodes (in num_decode_tokens too)


@dataclass(frozen=True, slots=True)
class StepPlan:
    slices: tuple[Slice, ...]  # decodes first, then prefills; one per request at most
    preempted_request_ids: tuple[str, ...]  # running requests to free, in preemption order
    quantum: int  # allocation unit of micro-slicing, tokens
    stats: PlanStats
    # Remedies, set only where the plan would otherwise be empty although requests wait or run
    # (core/remedies.py). The worker applies them before anything else of the plan.
    dropped_prefix_request_ids: tuple[str, ...] = ()  # waiting requests that give up their prefix hit
    failed_request_ids: tuple[str, ...] = ()  # requests that can never fit; only in a plan without slices
