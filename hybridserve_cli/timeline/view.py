"""The timeline's view model: recorded steps -> steps on an axis and one lane per request. Pure:
no I/O, no clocks; the page (page.js) and the Perfetto export only draw what this computes.

Two axes for everything drawn:
- the step axis: recorded step k (in file order) occupies positions [k, k + 1);
- the time axis: seconds since the first step started (or the first arrival, if earlier).
A step ran over [end - wall_s, end], clamped so it never starts before the previous one ended (older
files without `wall_s`: from the previous step's end). A time between or inside steps maps to a
position by linear interpolation inside the step that holds it, so a lane's marks line up on both.

A request's lane, in the order things happened to it:
    queued [arrival, first slice)  slice per step (prefill chunk [start, end) / decode)
    idle (running, but the plan gave it no tokens: no budget or no KV pages)
    preempted (a mark) -> queued again until its next slice   finished (a mark with the reason)
A slice planned for a request that had already finished (asynchronous scheduling plans one step
ahead) did not run: it is left out of the lane and counted as skipped in its step.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from hybridserve_cli.timeline.records import RequestEvent, StepRecord
from scheduler_svc.core import RequestState


@dataclass(frozen=True, slots=True)
class StepView:
    position: int  # place on the step axis: [position, position + 1)
    step_index: int  # the engine's step counter
    start_s: float  # seconds since the timeline's origin
    end_s: float
    num_decode_tokens: int  # executed decode tokens
    num_prefill_tokens: int  # executed prefill tokens
    num_draft_tokens: int  # speculative decoding: draft tokens the step verified, and accepted
    num_accepted_tokens: int
    budget_tokens: int  # max_num_batched_tokens
    prefill_budget_tokens: int  # what prefills could use after decodes
    micro_budget_tokens: int  # max_num_prefill_tokens_per_step (0 = off)
    prefill_share: float  # prefill's share of the service time the step was planned with; -1: no share mode
    prefill_share_target: float  # the share it was steered to; -1: no share mode
    block_size: int  # the checkpoint grid, tokens
    quantum: int  # micro-slicing unit, tokens
    stalled: bool  # prefills pending, budget >= one quantum, none scheduled
    micro_sliced: bool  # the prefill budget was split in quanta
    preempted_request_ids: tuple[str, ...]  # those the worker preempted (not ones already finished)
    num_running: int  # requests the scheduler saw running
    num_waiting: int  # requests the scheduler saw waiting
    num_free_kv_pages: int
    num_skipped_slices: int  # slices planned for requests that had already finished
    skipped_request_ids: tuple[str, ...]  # requests the plan named (slice, preemption) that had finished
    plan_latency_s: float
    trace_id: str  # "" when not traced
    plan_text: str  # exactly as `hybridserve replay FILE --step N` prints it
    reproduces: bool | None  # replay gives the identical plan; None: no recorded plan


@dataclass(frozen=True, slots=True)
class Segment:
    kind: str  # "queued", "prefill", "decode", or "idle" (running, but no slice in these steps)
    start_pos: float  # step axis
    end_pos: float
    start_s: float  # time axis, seconds since the origin
    end_s: float
    step_index: int  # the step that ran the slice; -1 for "queued" and "idle"
    token_start: int  # slices: computes positions [token_start, token_end); 0 otherwise
    token_end: int
    ends_on_checkpoint: bool  # the slice's end is a checkpoint: Mamba state saved there
    num_grid_boundaries: int  # multiples of block_size in (token_start, token_end]


@dataclass(frozen=True, slots=True)
class Mark:
    kind: str  # "preempted", "first_token" or "finished"
    pos: float  # step axis
    t_s: float  # time axis
    label: str  # the finish reason; the step index of a preemption


@dataclass(frozen=True, slots=True)
class Lane:
    request_id: str
    trace_id: str  # "" when not traced (or the request's events were not recorded)
    prompt_tokens: int  # as first seen
    completion_tokens: int  # at the finish; -1 when it did not finish within the recording
    cached_tokens: int
    finish_reason: str  # "" when it did not finish within the recording
    segments: tuple[Segment, ...]
    marks: tuple[Mark, ...]


@dataclass(frozen=True, slots=True)
class Timeline:
    origin_unix_s: float  # time 0 of the time axis
    steps: tuple[StepView, ...]
    lanes: tuple[Lane, ...]


class Clock:
    """Maps Unix seconds to both axes over the steps' intervals."""

    def __init__(self, intervals: list[tuple[float, float]], origin_unix_s: float) -> None:
        self.intervals = intervals
        self.origin_unix_s = origin_unix_s
        self._starts = [start for start, _ in intervals]

    def seconds(self, unix_s: float) -> float:
        return unix_s - self.origin_unix_s

    def position(self, unix_s: float) -> float:
        """Inside step k: k plus the fraction of it elapsed; between steps k and k+1: k + 1."""
        k = bisect.bisect_right(self._starts, unix_s) - 1
        if k < 0:
            return 0.0
        start, end = self.intervals[k]
        if unix_s >= end or end <= start:
            return float(k + 1)
        return k + (unix_s - start) / (end - start)


def step_intervals(records: list[StepRecord]) -> list[tuple[float, float]]:
    """(start, end) Unix seconds of each step; non-overlapping, in file order."""
    intervals: list[tuple[float, float]] = []
    for r in records:
        previous_end = intervals[-1][1] if intervals else None
        if r.wall_s is not None:
            start = r.end_unix_s - r.wall_s
        else:
            start = previous_end if previous_end is not None else r.end_unix_s - r.plan_latency_s
        if previous_end is not None:
            start = max(start, previous_end)
        intervals.append((min(start, r.end_unix_s), max(r.end_unix_s, previous_end or r.end_unix_s)))
    return intervals


def finish_events(records: list[StepRecord]) -> dict[str, tuple[int, RequestEvent]]:
    """request id -> (position of the line that carried it, the finished event)."""
    return {e.request_id: (k, e) for k, r in enumerate(records) for e in r.events if e.kind == "finished"}


def ran(request_id: str, k: int, start_unix_s: float, finished: dict[str, tuple[int, RequestEvent]]) -> bool:
    """What step k's plan says of a request (a slice, a preemption) happened unless the request had
    finished before the step started: asynchronous scheduling plans a step before the previous one
    ends, and the worker skips what the plan says of requests that ended meanwhile."""
    if request_id not in finished:
        return True
    line, event = finished[request_id]
    return not (line < k or (line == k and event.finish_unix_s is not None and event.finish_unix_s <= start_unix_s))


def grid_boundaries(start: int, end: int, block_size: int) -> int:
    """Multiples of block_size in (start, end]: where a prefill chunk crosses the checkpoint grid."""
    return end // block_size - start // block_size if block_size > 0 else 0


@dataclass(slots=True)
class _LaneBuilder:
    """A lane while the steps are walked (mutable; frozen into a Lane at the end)."""

    request_id: str
    arrival: tuple[float, float]  # (position, seconds) it entered the queue, as best known
    trace_id: str = ""
    prompt_tokens: int = 0
    queued_since: tuple[float, float] | None = None  # waiting from here until its next slice
    segments: list[Segment] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    derived_first_token: tuple[float, float] | None = None  # end of the step whose prefill completed
    finish: RequestEvent | None = None

    def take_event(self, event: RequestEvent, clock: Clock) -> None:
        self.trace_id = event.trace_id or self.trace_id
        self.prompt_tokens = self.prompt_tokens or event.prompt_tokens
        if event.arrival_unix_s is not None:
            arrival = (clock.position(event.arrival_unix_s), clock.seconds(event.arrival_unix_s))
            if self.queued_since == self.arrival and not self.segments:
                self.queued_since = arrival
            self.arrival = min(self.arrival, arrival)
        if event.kind == "finished":
            self.finish = event

    def preempted(self, k: int, start_s: float, step_index: int) -> None:
        self.marks.append(Mark("preempted", float(k), start_s, str(step_index)))
        self.queued_since = (float(k), start_s)

    def idle(self, k: int, span: tuple[float, float]) -> None:
        """Running but given no tokens in step k (extends the idle stretch of step k - 1)."""
        last = self.segments[-1] if self.segments else None
        if last is not None and last.kind == "idle" and last.end_pos == k:
            self.segments[-1] = Segment("idle", last.start_pos, k + 1, last.start_s, span[1], -1, 0, 0, False, 0)
        else:
            self.segments.append(Segment("idle", float(k), float(k + 1), span[0], span[1], -1, 0, 0, False, 0))

    def add_slice(self, slice_: Segment, state: RequestState) -> None:
        if self.queued_since is not None:
            pos, t_s = self.queued_since
            self.segments.append(
                Segment("queued", pos, max(pos, slice_.start_pos), t_s, max(t_s, slice_.start_s), -1, 0, 0, False, 0)
            )
            self.queued_since = None
        self.segments.append(slice_)
        completes_prompt = slice_.token_end >= state.num_prompt_tokens
        if slice_.kind == "prefill" and completes_prompt and self.derived_first_token is None:
            self.derived_first_token = (slice_.end_pos, slice_.end_s)

    def freeze(self, clock: Clock) -> Lane:
        marks = list(self.marks)
        finish = self.finish
        if self.queued_since is not None:  # still waiting when it finished (aborted) or at the end
            if finish is not None and finish.finish_unix_s is not None:
                end = (clock.position(finish.finish_unix_s), clock.seconds(finish.finish_unix_s))
            else:
                end = (float(len(clock.intervals)), clock.seconds(clock.intervals[-1][1]))
            (pos, t_s), self.queued_since = self.queued_since, None
            self.segments.append(Segment("queued", pos, max(pos, end[0]), t_s, max(t_s, end[1]), -1, 0, 0, False, 0))
        if finish is not None and finish.first_token_unix_s is not None:
            t = finish.first_token_unix_s
            marks.append(Mark("first_token", clock.position(t), clock.seconds(t), ""))
        elif self.derived_first_token is not None:
            marks.append(Mark("first_token", *self.derived_first_token, ""))
        if finish is not None and finish.finish_unix_s is not None:
            t = finish.finish_unix_s
            marks.append(Mark("finished", clock.position(t), clock.seconds(t), finish.reason))
        return Lane(
            request_id=self.request_id,
            trace_id=self.trace_id,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=finish.completion_tokens if finish is not None else -1,
            cached_tokens=finish.cached_tokens if finish is not None else 0,
            finish_reason=finish.reason if finish is not None else "",
            segments=tuple(self.segments),
            marks=tuple(sorted(marks, key=lambda m: (m.pos, m.t_s))),
        )


def slice_segment(k: int, record: StepRecord, state: RequestState, num_tokens: int, checkpoint: bool,
                  span: tuple[float, float]) -> Segment:  # fmt: skip
    """One executed slice: the chunk [computed, computed + num_tokens) of step k."""
    start, end = state.num_computed_tokens, state.num_computed_tokens + num_tokens
    is_prefill = state.num_computed_tokens < state.num_prompt_tokens
    block_size = record.step_input.config.block_size
    return Segment(
        "prefill" if is_prefill else "decode", float(k), float(k + 1), span[0], span[1], record.step_index,
        start, end, checkpoint, grid_boundaries(start, end, block_size) if is_prefill else 0,
    )  # fmt: skip


def step_view(
    k: int,
    record: StepRecord,
    span: tuple[float, float],
    executed: list[Segment],
    served: set[str],
    preempted: list[str],
) -> StepView:
    config, stats = record.step_input.config, record.plan.stats
    share = record.step_input.share if config.has_prefill_share else None
    named = {s.request_id for s in record.plan.slices} | set(record.plan.preempted_request_ids)
    return StepView(
        position=k,
        step_index=record.step_index,
        start_s=span[0],
        end_s=span[1],
        num_decode_tokens=sum(s.token_end - s.token_start for s in executed if s.kind == "decode"),
        num_prefill_tokens=sum(s.token_end - s.token_start for s in executed if s.kind == "prefill"),
        num_draft_tokens=sum(d for _, d, _ in record.drafts),
        num_accepted_tokens=sum(a for _, _, a in record.drafts),
        budget_tokens=config.max_num_batched_tokens,
        prefill_budget_tokens=stats.prefill_budget_tokens,
        micro_budget_tokens=config.max_num_prefill_tokens_per_step,
        prefill_share=share.share if share is not None else -1.0,
        prefill_share_target=share.target if share is not None else -1.0,
        block_size=config.block_size,
        quantum=record.plan.quantum,
        stalled=stats.stalled,
        micro_sliced=stats.micro_sliced,
        preempted_request_ids=tuple(preempted),
        num_running=len(record.step_input.running),
        num_waiting=len(record.step_input.waiting),
        num_free_kv_pages=record.step_input.num_free_kv_pages,
        num_skipped_slices=len(record.plan.slices) - len(executed),
        skipped_request_ids=tuple(sorted(named - served - set(preempted))),
        plan_latency_s=record.plan_latency_s,
        trace_id=record.trace_id,
        plan_text=record.plan_text,
        reproduces=record.reproduces,
    )


def _lane_of(lanes: dict[str, _LaneBuilder], request_id: str, k: int, start_s: float) -> _LaneBuilder:
    """The request's lane; a new one is queued from step k until an event says when it arrived."""
    lane = lanes.get(request_id)
    if lane is None:
        lane = lanes[request_id] = _LaneBuilder(request_id, (float(k), start_s))
        lane.queued_since = lane.arrival
    return lane


def build_timeline(records: list[StepRecord]) -> Timeline:
    """The view model of recorded steps (in file order)."""
    if not records:
        return Timeline(0.0, (), ())
    intervals = step_intervals(records)
    arrivals = [e.arrival_unix_s for r in records for e in r.events if e.arrival_unix_s is not None]
    clock = Clock(intervals, min([intervals[0][0], *arrivals]))
    finished = finish_events(records)
    lanes: dict[str, _LaneBuilder] = {}
    steps = []
    for k, (record, (start, end)) in enumerate(zip(records, intervals, strict=True)):
        span = (clock.seconds(start), clock.seconds(end))
        states = {s.request_id: s for s in (*record.step_input.running, *record.step_input.waiting)}
        for state in states.values():
            lane = _lane_of(lanes, state.request_id, k, span[0])
            lane.prompt_tokens = lane.prompt_tokens or state.num_prompt_tokens
        for event in record.events:
            _lane_of(lanes, event.request_id, k, span[0]).take_event(event, clock)
        preempted = [r for r in record.plan.preempted_request_ids if r in lanes and ran(r, k, start, finished)]
        for request_id in preempted:
            lanes[request_id].preempted(k, span[0], record.step_index)
        executed: list[Segment] = []
        served: set[str] = set()
        for s in record.plan.slices:
            if s.request_id in states and ran(s.request_id, k, start, finished):
                segment = slice_segment(k, record, states[s.request_id], s.num_tokens, s.ends_on_checkpoint, span)
                lanes[s.request_id].add_slice(segment, states[s.request_id])
                executed.append(segment)
                served.add(s.request_id)
        for state in record.step_input.running:
            rid = state.request_id
            if rid not in served and rid not in preempted and ran(rid, k, start, finished):
                lanes[rid].idle(k, span)
        steps.append(step_view(k, record, span, executed, served, preempted))
    ordered = sorted(lanes.values(), key=lambda lane: (lane.arrival, lane.request_id))
    return Timeline(clock.origin_unix_s, tuple(steps), tuple(lane.freeze(clock) for lane in ordered))
