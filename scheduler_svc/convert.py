"""Wire <-> domain conversion for the Scheduler service. Free functions; they validate what the
wire allows but the domain does not (absent config, unknown enum values) and raise domain errors."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from itertools import repeat
from typing import Any, TypeVar

from hybridserve.errors import InvalidArgumentError
from hybridserve.v1 import scheduler_pb2 as pb
from scheduler_svc.core import (
    MambaCacheMode,
    PinnedPages,
    PlanStats,
    PrefillShareMode,
    RequestState,
    SchedulerConfig,
    ShareState,
    Slice,
    StepInput,
    StepPlan,
)
from scheduler_svc.core.steady import StateColumns

T = TypeVar("T", bound=tuple[Any, ...])


def rows_from_columns(cls: type[T], columns: Iterable[Iterable[Any]]) -> tuple[T, ...]:
    """NamedTuples of `cls` from columns in its field order. tuple.__new__ is a C call per row where
    the NamedTuple's own constructor is a Python function: about half the time at 256 rows."""
    return tuple(map(tuple.__new__, repeat(cls), zip(*columns, strict=True)))


def config_from_pb(msg: pb.SchedulerConfig) -> SchedulerConfig:
    try:
        mode = MambaCacheMode(msg.mamba_cache_mode)
    except ValueError:
        raise InvalidArgumentError(
            f"config.mamba_cache_mode = {msg.mamba_cache_mode} is unknown; use NONE (0) or ALIGN (1)"
        ) from None
    try:
        share_mode = PrefillShareMode(msg.prefill_share_mode)
    except ValueError:
        raise InvalidArgumentError(
            f"config.prefill_share_mode = {msg.prefill_share_mode} is unknown; use OFF (0), FIXED (1) or AUTO (2)"
        ) from None
    return SchedulerConfig(
        max_num_batched_tokens=msg.max_num_batched_tokens,
        max_num_seqs=msg.max_num_seqs,
        long_prefill_token_threshold=msg.long_prefill_token_threshold,
        max_num_prefill_tokens_per_step=msg.max_num_prefill_tokens_per_step,
        block_size=msg.block_size,
        mamba_block_size=msg.mamba_block_size,
        mamba_cache_mode=mode,
        kv_page_size=msg.kv_page_size,
        stop_at_last_boundary=msg.stop_at_last_boundary,
        micro_slice_long_prompts_only=msg.micro_slice_long_prompts_only,
        prefill_share_mode=share_mode,
        prefill_share=msg.prefill_share,
        prefill_share_min=msg.prefill_share_min,
        prefill_share_max=msg.prefill_share_max,
        prefill_share_deadband=msg.prefill_share_deadband,
        prefill_share_half_life_s=msg.prefill_share_half_life_s,
        prefill_share_slew_per_s=msg.prefill_share_slew_per_s,
    )


def config_to_pb(config: SchedulerConfig) -> pb.SchedulerConfig:
    return pb.SchedulerConfig(
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_num_seqs=config.max_num_seqs,
        long_prefill_token_threshold=config.long_prefill_token_threshold,
        max_num_prefill_tokens_per_step=config.max_num_prefill_tokens_per_step,
        block_size=config.block_size,
        mamba_block_size=config.mamba_block_size,
        mamba_cache_mode=int(config.mamba_cache_mode),  # type: ignore[arg-type]
        kv_page_size=config.kv_page_size,
        stop_at_last_boundary=config.stop_at_last_boundary,
        micro_slice_long_prompts_only=config.micro_slice_long_prompts_only,
        prefill_share_mode=int(config.prefill_share_mode),  # type: ignore[arg-type]
        prefill_share=config.prefill_share,
        prefill_share_min=config.prefill_share_min,
        prefill_share_max=config.prefill_share_max,
        prefill_share_deadband=config.prefill_share_deadband,
        prefill_share_half_life_s=config.prefill_share_half_life_s,
        prefill_share_slew_per_s=config.prefill_share_slew_per_s,
    )


def share_from_pb(msg: pb.PlanStepRequest) -> ShareState | None:
    """The request's share accounting, or None when it sent none."""
    if not msg.HasField("share"):
        return None
    s = msg.share
    return ShareState(s.prefill_service_s, s.decode_service_s, s.target, s.prefill_token_s, s.decode_row_s, s.forward_s)


def _fill_share(msg: pb.PlanStepRequest, share: ShareState | None) -> None:
    if share is not None:
        msg.share.CopyFrom(pb.ShareState(
            prefill_service_s=share.prefill_service_s, decode_service_s=share.decode_service_s, target=share.target,
            prefill_token_s=share.prefill_token_s, decode_row_s=share.decode_row_s, forward_s=share.forward_s,
        ))  # fmt: skip


def pinned_from_pb(msg: pb.PlanStepRequest) -> tuple[PinnedPages, ...]:
    """The pages waiting hits pin, as sent (the planner checks them against the waiting requests)."""
    return tuple([PinnedPages(p.request_id, p.num_kv_pages) for p in msg.pinned_kv_pages])


def _fill_pinned(msg: pb.PlanStepRequest, pinned: tuple[PinnedPages, ...]) -> None:
    add = msg.pinned_kv_pages.add
    for p in pinned:
        add(request_id=p.request_id, num_kv_pages=p.num_kv_pages)


def state_from_pb(msg: pb.RequestState) -> RequestState:
    # Positional, in RequestState's field order: this runs for every request of every step, and
    # keyword construction costs about 40% more.
    return RequestState(
        msg.request_id,
        msg.num_prompt_tokens,
        msg.num_computed_tokens,
        msg.num_output_tokens,
        msg.max_tokens,
        msg.priority,
        msg.arrival_time,
        msg.num_draft_tokens,
    )


def state_to_pb(state: RequestState) -> pb.RequestState:
    return pb.RequestState(
        request_id=state.request_id,
        num_prompt_tokens=state.num_prompt_tokens,
        num_computed_tokens=state.num_computed_tokens,
        num_output_tokens=state.num_output_tokens,
        max_tokens=state.max_tokens,
        priority=state.priority,
        arrival_time=state.arrival_time,
        num_draft_tokens=state.num_draft_tokens,
    )


def states_from_columns(msg: pb.RequestStateColumns, name: str) -> tuple[RequestState, ...]:
    """The states of one queue sent as columns; every column must have one entry per request
    (num_draft_tokens may instead be empty: every request has 0)."""
    drafts = msg.num_draft_tokens
    columns: tuple[Sequence[Any], ...] = (
        msg.request_id, msg.num_prompt_tokens, msg.num_computed_tokens, msg.num_output_tokens,
        msg.max_tokens, msg.priority, msg.arrival_time, drafts if drafts else [0] * len(msg.request_id),
    )  # fmt: skip
    if len({len(c) for c in columns}) > 1:
        sent = (*columns[:-1], drafts)
        counts = ", ".join(f"{field} {len(c)}" for field, c in zip(RequestState._fields, sent, strict=True))
        raise InvalidArgumentError(
            f"{name}: every column needs one entry per request (num_draft_tokens may be empty: all 0); got {counts}"
        )
    return rows_from_columns(RequestState, columns)


def columns_from_pb(msg: pb.RequestStateColumns) -> StateColumns:
    """One queue's columns as lists (the steady-decode path reads each several times); unequal
    lengths are left to the planner's checks."""
    return StateColumns(
        list(msg.request_id), list(msg.num_prompt_tokens), list(msg.num_computed_tokens),
        list(msg.num_output_tokens), list(msg.max_tokens), list(msg.priority), list(msg.arrival_time),
        list(msg.num_draft_tokens),
    )  # fmt: skip


def is_columnar(msg: pb.PlanStepRequest) -> bool:
    """Whether the request sent its states as columns (and wants its slices back as columns)."""
    return msg.HasField("running_columns") or msg.HasField("waiting_columns")


def step_from_pb(msg: pb.PlanStepRequest) -> StepInput:
    if not msg.HasField("config"):
        raise InvalidArgumentError("config is required: send the SchedulerConfig with every PlanStep")
    if is_columnar(msg):
        if msg.running or msg.waiting:
            raise InvalidArgumentError(
                "send the request states once: either running/waiting or running_columns/waiting_columns"
            )
        running = states_from_columns(msg.running_columns, "running_columns")
        waiting = states_from_columns(msg.waiting_columns, "waiting_columns")
    else:
        running = tuple([state_from_pb(r) for r in msg.running])
        waiting = tuple([state_from_pb(r) for r in msg.waiting])
    return StepInput(
        config=config_from_pb(msg.config),
        running=running,
        waiting=waiting,
        step_index=msg.step_index,
        num_free_kv_pages=msg.num_free_kv_pages,
        share=share_from_pb(msg),
        pinned_kv_pages=pinned_from_pb(msg),
    )


def step_to_pb(step: StepInput) -> pb.PlanStepRequest:
    msg = pb.PlanStepRequest(
        config=config_to_pb(step.config), step_index=step.step_index, num_free_kv_pages=step.num_free_kv_pages
    )
    _fill_share(msg, step.share)
    _fill_pinned(msg, step.pinned_kv_pages)
    # In place, as plan_to_pb does: this runs for every request of every step.
    for add, states in ((msg.running.add, step.running), (msg.waiting.add, step.waiting)):
        for r in states:
            add(
                request_id=r.request_id,
                num_prompt_tokens=r.num_prompt_tokens,
                num_computed_tokens=r.num_computed_tokens,
                num_output_tokens=r.num_output_tokens,
                max_tokens=r.max_tokens,
                priority=r.priority,
                arrival_time=r.arrival_time,
                num_draft_tokens=r.num_draft_tokens,
            )
    return msg


def _fill_columns(columns: pb.RequestStateColumns, states: tuple[RequestState, ...]) -> None:
    if not states:
        columns.SetInParent()  # present though empty: the request is in columns
        return
    ids, prompts, computed, outputs, max_tokens, priorities, arrivals, drafts = zip(*states, strict=True)
    columns.request_id.extend(ids)
    columns.num_prompt_tokens.extend(prompts)
    columns.num_computed_tokens.extend(computed)
    columns.num_output_tokens.extend(outputs)
    columns.max_tokens.extend(max_tokens)
    columns.priority.extend(priorities)
    columns.arrival_time.extend(arrivals)
    if any(drafts):  # empty means all 0: what a step without drafts sends
        columns.num_draft_tokens.extend(drafts)


def step_to_pb_columns(step: StepInput) -> pb.PlanStepRequest:
    """The request as columns (RequestStateColumns): what the worker sends every step. A field's
    values go in with one extend each instead of a message per request: about a tenth of the
    Python work of step_to_pb at 256 requests, and the service's parse shrinks alike."""
    msg = pb.PlanStepRequest(
        config=config_to_pb(step.config), step_index=step.step_index, num_free_kv_pages=step.num_free_kv_pages
    )
    _fill_columns(msg.running_columns, step.running)
    _fill_columns(msg.waiting_columns, step.waiting)
    _fill_share(msg, step.share)
    _fill_pinned(msg, step.pinned_kv_pages)
    return msg


def plan_to_pb(plan: StepPlan, columns: bool = False) -> pb.PlanStepResponse:
    """The plan on the wire; with `columns` its slices as SliceColumns (the answer to a request
    sent as columns)."""
    stats = plan.stats
    msg = pb.PlanStepResponse(
        preempted_request_ids=list(plan.preempted_request_ids),
        quantum=plan.quantum,
        dropped_prefix_request_ids=list(plan.dropped_prefix_request_ids),
        failed_request_ids=list(plan.failed_request_ids),
        stats=pb.PlanStats(
            num_decode_tokens=stats.num_decode_tokens,
            num_prefill_tokens=stats.num_prefill_tokens,
            prefill_budget_tokens=stats.prefill_budget_tokens,
            num_pending_prefills=stats.num_pending_prefills,
            stalled=stats.stalled,
            micro_sliced=stats.micro_sliced,
            num_kv_pages_allocated=stats.num_kv_pages_allocated,
            num_draft_tokens=stats.num_draft_tokens,
        ),
    )
    if columns:
        out = msg.slice_columns
        out.SetInParent()
        if plan.slices:
            ids, num_tokens, is_prefill, ends_on_checkpoint = zip(*plan.slices, strict=True)
            out.request_id.extend(ids)
            out.num_tokens.extend(num_tokens)
            out.is_prefill.extend(is_prefill)
            out.ends_on_checkpoint.extend(ends_on_checkpoint)
        return msg
    add = msg.slices.add  # in place: building Slice messages first and copying them costs a third more
    for s in plan.slices:
        add(
            request_id=s.request_id,
            num_tokens=s.num_tokens,
            is_prefill=s.is_prefill,
            ends_on_checkpoint=s.ends_on_checkpoint,
        )
    return msg


def slices_from_pb(msg: pb.PlanStepResponse) -> tuple[Slice, ...]:
    if msg.HasField("slice_columns"):
        c = msg.slice_columns
        columns = (c.request_id, c.num_tokens, c.is_prefill, c.ends_on_checkpoint)
        if len({len(column) for column in columns}) > 1:
            raise InvalidArgumentError("slice_columns: every column needs one entry per slice")
        return rows_from_columns(Slice, columns)
    # Positional, in Slice's field order: one per slice of every step.
    return tuple([Slice(s.request_id, s.num_tokens, s.is_prefill, s.ends_on_checkpoint) for s in msg.slices])


def plan_from_pb(msg: pb.PlanStepResponse) -> StepPlan:
    stats = msg.stats
    return StepPlan(
        slices=slices_from_pb(msg),
        preempted_request_ids=tuple(msg.preempted_request_ids),
        quantum=msg.quantum,
        stats=PlanStats(
            num_decode_tokens=stats.num_decode_tokens,
            num_prefill_tokens=stats.num_prefill_tokens,
            prefill_budget_tokens=stats.prefill_budget_tokens,
            num_pending_prefills=stats.num_pending_prefills,
            stalled=stats.stalled,
            micro_sliced=stats.micro_sliced,
            num_kv_pages_allocated=stats.num_kv_pages_allocated,
            num_draft_tokens=stats.num_draft_tokens,
        ),
        dropped_prefix_request_ids=tuple(msg.dropped_prefix_request_ids),
        failed_request_ids=tuple(msg.failed_request_ids),
    )
