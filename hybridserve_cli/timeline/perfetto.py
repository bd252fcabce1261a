"""The timeline as Chrome trace-event JSON (the format Perfetto, chrome://tracing and most trace
viewers open): process 1 holds the steps on one track, process 2 one track per request.

One complete event ("ph": "X") per step, per queued stretch and per executed slice; an instant
event ("ph": "i") per preemption and per finish; metadata events ("ph": "M") name the tracks.
Times are microseconds since the timeline's origin. Every event carries name, ph, ts, pid and tid.
"""

from __future__ import annotations

from typing import Any

from hybridserve_cli.timeline.view import Lane, StepView, Timeline

STEPS_PID, REQUESTS_PID = 1, 2


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _dur(start_s: float, end_s: float) -> float:
    """Rounded from the rounded ends, so adjacent events stay adjacent."""
    return round(_us(end_s) - _us(start_s), 3)


def _metadata(pid: int, tid: int, kind: str, name: str) -> dict[str, Any]:
    return {"name": kind, "ph": "M", "ts": 0, "pid": pid, "tid": tid, "args": {"name": name}}


def step_event(step: StepView) -> dict[str, Any]:
    flags = [f for f, on in (("stalled", step.stalled), ("micro-sliced", step.micro_sliced)) if on]
    if step.preempted_request_ids:
        flags.append("preempting")
    return {
        "name": f"step {step.step_index}" + (f" ({', '.join(flags)})" if flags else ""),
        "cat": "step",
        "ph": "X",
        "ts": _us(step.start_s),
        "dur": _dur(step.start_s, step.end_s),
        "pid": STEPS_PID,
        "tid": 0,
        "args": {
            "step_index": step.step_index,
            "decode_tokens": step.num_decode_tokens,
            "prefill_tokens": step.num_prefill_tokens,
            "budget_tokens": step.budget_tokens,
            "prefill_budget_tokens": step.prefill_budget_tokens,
            "prefill_share": step.prefill_share,
            "prefill_share_target": step.prefill_share_target,
            "quantum": step.quantum,
            "stalled": step.stalled,
            "micro_sliced": step.micro_sliced,
            "preempted": list(step.preempted_request_ids),
            "skipped_slices": step.num_skipped_slices,
            "replay_identical": step.reproduces,
            "trace_id": step.trace_id,
        },
    }


def lane_events(lane: Lane, tid: int) -> list[dict[str, Any]]:
    events = [_metadata(REQUESTS_PID, tid, "thread_name", lane.request_id)]
    for seg in lane.segments:
        name = seg.kind if seg.kind != "prefill" else f"prefill [{seg.token_start}, {seg.token_end})"
        args: dict[str, Any] = {"request_id": lane.request_id, "trace_id": lane.trace_id}
        if seg.kind != "queued":
            args.update(step_index=seg.step_index, tokens=seg.token_end - seg.token_start,
                        token_start=seg.token_start, token_end=seg.token_end,
                        ends_on_checkpoint=seg.ends_on_checkpoint)  # fmt: skip
        events.append(
            {"name": name, "cat": seg.kind, "ph": "X", "ts": _us(seg.start_s), "dur": _dur(seg.start_s, seg.end_s),
             "pid": REQUESTS_PID, "tid": tid, "args": args}
        )  # fmt: skip
    for mark in lane.marks:
        if mark.kind == "first_token":
            continue
        name = "preempted" if mark.kind == "preempted" else f"finished: {mark.label}"
        events.append(
            {"name": name, "cat": mark.kind, "ph": "i", "s": "t", "ts": _us(mark.t_s), "pid": REQUESTS_PID,
             "tid": tid, "args": {"request_id": lane.request_id}}
        )  # fmt: skip
    return events


def trace_events(timeline: Timeline) -> dict[str, Any]:
    """The whole timeline as a trace-event JSON object."""
    events = [
        _metadata(STEPS_PID, 0, "process_name", "hybridserve steps"),
        _metadata(STEPS_PID, 0, "thread_name", "steps"),
        _metadata(REQUESTS_PID, 0, "process_name", "hybridserve requests"),
    ]
    events += [step_event(step) for step in timeline.steps]
    for tid, lane in enumerate(timeline.lanes, 1):
        events += lane_events(lane, tid)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {"origin_unix_s": timeline.origin_unix_s, "source": "hybridserve timeline"},
    }
