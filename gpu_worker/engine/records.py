"""What the engine tells its observers: one frozen record per step and one per request event, and
the engine's running totals (`EngineCounters`) added up from the step records.

Observers (tracing, metrics, step recording) read only these records; nothing they need requires a
reference to the engine, its requests or its pools. Times are monotonic seconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import itemgetter
from typing import NamedTuple

from gpu_worker.cache.interface import CacheLookup
from gpu_worker.engine.request import FinishReason
from hybridserve.errors import HybridServeError
from scheduler_svc.core import StepInput, StepPlan

__all__ = ["CacheLookup", "FirstToken", "Occupancy", "RequestFinished", "RequestQueued", "ServedSlice", "StepRecord"]


@dataclass(frozen=True, slots=True)
class Occupancy:
    """Queues and pools at one moment."""

    num_running: int  # requests holding a state slot
    num_waiting: int  # queued, not admitted (fetching from the shared tier not included)
    num_kv_pages_used: int  # pages not on the free list (cached blocks included)
    num_kv_pages_total: int
    num_state_slots_used: int  # live slots (checkpoint slots not included)
    num_state_slots_total: int


class ServedSlice(NamedTuple):
    """One slice of the plan that ran, in batch row order.

    A NamedTuple, immutable like a frozen dataclass: one is built per row every step, and a
    frozen dataclass costs two to four times as much to construct.
    """

    request_id: str
    num_tokens: int  # computed this step
    is_prefill: bool
    ends_on_checkpoint: bool  # the chunk ends on the block grid (ALIGN mode)
    sampled: bool  # the step yielded a token for the request
    num_output_tokens: int  # the request's generated tokens after this step


_NUM_TOKENS = itemgetter(ServedSlice._fields.index("num_tokens"))
_SAMPLED = itemgetter(ServedSlice._fields.index("sampled"))


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One executed engine step."""

    step_index: int
    step_input: StepInput | None  # what the scheduler was sent for this plan
    plan: StepPlan  # as the scheduler returned it
    served: tuple[ServedSlice, ...]  # slices that ran (planned slices of ended requests are skipped)
    preempted_request_ids: tuple[str, ...]  # preempted in this step: by the plan or for lack of pages
    plan_wait_s: float  # the step blocked this long on the scheduler
    plan_latency_s: float  # PlanStep round trip of this plan
    wall_s: float  # the whole step: planning wait + prepare + forward + sample + apply
    end_time_s: float  # when the step's tokens were applied
    occupancy: Occupancy  # after the step
    drafts: tuple[tuple[str, int, int], ...] = ()  # speculative decoding: (request id, drafted, accepted) per row

    @property
    def num_draft_tokens(self) -> int:
        return sum(d for _, d, _ in self.drafts)

    @property
    def num_accepted_tokens(self) -> int:
        return sum(a for _, _, a in self.drafts)

    @property
    def num_skipped_slices(self) -> int:
        return len(self.plan.slices) - len(self.served)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(s.num_tokens for s in self.served if s.is_prefill)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_tokens for s in self.served if not s.is_prefill)

    @property
    def num_computed_tokens(self) -> int:
        return sum(map(_NUM_TOKENS, self.served))  # a C loop: the counters read it every step

    @property
    def num_sampled_tokens(self) -> int:
        return sum(map(_SAMPLED, self.served))


@dataclass(frozen=True, slots=True)
class RequestQueued:
    """A request passed admission and entered the queue."""

    request_id: str
    num_prompt_tokens: int
    max_tokens: int
    priority: int
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    stop: tuple[str, ...]
    arrival_time: float


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The request's first generated token was sampled."""

    request_id: str
    arrival_time: float
    first_token_time: float


@dataclass(frozen=True, slots=True)
class RequestFinished:
    """The request left the engine; its last event follows."""

    request_id: str
    reason: FinishReason
    error: HybridServeError | None  # set when reason is ERROR
    num_prompt_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache
    num_output_tokens: int
    arrival_time: float
    finish_time: float
    num_draft_tokens: int = 0  # speculative decoding: drafts verified, and accepted
    num_accepted_tokens: int = 0


@dataclass(slots=True)
class EngineCounters:
    """Read by GetInfo and tests from any thread (plain numbers: a stale read is harmless)."""

    num_steps: int = 0
    step_wall_seconds: float = 0.0  # whole steps: planning wait + forward + apply
    scheduler_wait_seconds: float = 0.0  # part of the above spent blocked on the scheduler
    num_preemptions: int = 0  # requests preempted (by plans, or for lack of pages)
    num_stalled_steps: int = 0
    num_generated_tokens: int = 0
    num_computed_tokens: int = 0  # tokens run through the model (prefill chunks + decodes)
    num_draft_tokens: int = 0  # speculative decoding: draft tokens verified, and accepted
    num_accepted_tokens: int = 0

    def add_step(self, record: StepRecord) -> None:
        """Adds one executed step."""
        self.num_steps += 1
        self.step_wall_seconds += record.wall_s
        self.scheduler_wait_seconds += record.plan_wait_s
        self.num_preemptions += len(record.preempted_request_ids)
        self.num_stalled_steps += int(record.plan.stats.stalled)
        self.num_computed_tokens += record.num_computed_tokens
        self.num_generated_tokens += record.num_sampled_tokens
        if record.drafts:
            accepted = record.num_accepted_tokens
            self.num_generated_tokens += accepted  # each accepted draft is a generated token
            self.num_draft_tokens += record.num_draft_tokens
            self.num_accepted_tokens += accepted
