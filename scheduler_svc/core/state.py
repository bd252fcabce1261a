"""What the planner is told each step: the worker's full scheduling state."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.share import ShareState


class RequestState(NamedTuple):
    """One request as the planner sees it. A NamedTuple, immutable like the frozen dataclasses
    here: one is built per request per step on both sides of the wire, and a frozen dataclass costs
    two to four times as much to construct (a changed copy: `state._replace(field=value)`)."""

    request_id: str
    num_prompt_tokens: int  # tokens known before generation (preempted: incl. generated ones)
    num_computed_tokens: int  # tokens whose KV and state exist: [0, num_computed_tokens)
    num_output_tokens: int  # tokens generated so far; the newest is not computed yet
    max_tokens: int  # generation limit, tokens
    priority: int  # smaller is served first
    arrival_time: float  # ties in priority go to the earlier arrival
    # Speculative decoding: draft tokens ready for this running decode, which asks to verify
    # 1 + num_draft_tokens tokens; 0 on a prefill or a waiting request (validation.py). The last
    # field, so a request without drafts is built as before.
    num_draft_tokens: int = 0

    @property
    def is_prefill(self) -> bool:
        return self.num_computed_tokens < self.num_prompt_tokens

    @property
    def num_prefill_tokens_left(self) -> int:
        """Prompt tokens still to compute: [num_computed_tokens, num_prompt_tokens)."""
        return max(self.num_prompt_tokens - self.num_computed_tokens, 0)

    @property
    def queue_key(self) -> tuple[int, float]:
        """Service order: priority first, then arrival. A preempted request keeps its arrival time
        and so its place."""
        return (self.priority, self.arrival_time)


class PinnedPages(NamedTuple):
    """The KV pages a waiting request's prefix-cache hit pins: they are neither free nor reclaimable
    while it waits, and giving the hit up (the request then computes its whole prompt) would make
    them reclaimable. Pages another request holds too are not counted: giving this hit up frees
    none of them."""

    request_id: str  # a waiting request with num_computed_tokens > 0 (its hit)
    num_kv_pages: int  # pages, at most those of its computed tokens


@dataclass(frozen=True, slots=True)
class StepInput:
    config: SchedulerConfig
    running: tuple[RequestState, ...]  # hold pages and state slots, in the worker's order
    waiting: tuple[RequestState, ...]  # not admitted yet, any order
    step_index: int  # engine step counter; rotates micro-slice remainders
    num_free_kv_pages: int  # pages free in the worker's pool now
    share: ShareState | None = None  # the prefill compute share's accounting (config.prefill_share_mode on)
    pinned_kv_pages: tuple[PinnedPages, ...] = ()  # waiting hits' pinned pages; a hit not listed pins none
