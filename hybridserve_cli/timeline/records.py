"""Reads a `--record-steps` JSONL file into step records, each with its replay.

The file is read by the step-record module's reader (scheduler_svc/step_records.py: the format, its
writer and its reader), and the replay is `scheduler_svc.replay`'s own (`replay_one`, `render`), so
the plan text a step shows is byte for byte what `hybridserve replay FILE --step N` prints for it.
The optional keys a newer recorder writes (`wall_s`, `trace_id`, `request_events`, `drafts`) are read too;
files without them still load.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from hybridserve.errors import InvalidArgumentError
from scheduler_svc import convert
from scheduler_svc.core import StepInput, StepPlan
from scheduler_svc.replay import Replayed, render, replay_one
from scheduler_svc.step_records import RequestEvent, read_steps

__all__ = ["RequestEvent", "StepRecord", "load_records"]


@dataclass(frozen=True, slots=True)
class StepRecord:
    step_index: int  # the engine's step counter
    step_input: StepInput  # what the scheduler was sent
    plan: StepPlan  # the plan the step executed (the replayed one when the record has none)
    end_unix_s: float  # Unix seconds when the step was recorded (its end)
    wall_s: float | None  # the whole step, seconds; None in files from older recorders
    plan_latency_s: float  # the PlanStep round trip, seconds
    trace_id: str  # 32 hex digits of the step span's trace, "" when not traced
    events: tuple[RequestEvent, ...]  # request events seen since the previous recorded step
    plan_text: str  # the step as `hybridserve replay FILE --step N` prints it
    reproduces: bool | None  # replay gives the identical plan; None when nothing was recorded to compare
    drafts: tuple[tuple[str, int, int], ...] = ()  # (request id, drafted, accepted) of the drafted rows verified


def load_records(path: Path) -> list[StepRecord]:
    """Every step of the file in file order, replayed; InvalidArgumentError on a bad file."""
    records = []
    for step in read_steps(path):  # raises InvalidArgumentError naming the bad line
        try:
            events = step.events()
            end_unix_s = step.end_unix_s
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"{path}: step {step.step_index}: bad timeline fields: {exc!r}") from None
        replayed = Replayed(step.step_index, step.plan, replay_one(step.request, {}), step.drafts())
        executed = step.plan if step.plan is not None else replayed.replayed
        records.append(
            StepRecord(
                step_index=step.step_index,
                step_input=convert.step_from_pb(step.request),
                plan=convert.plan_from_pb(executed),
                end_unix_s=end_unix_s,
                wall_s=step.wall_s,
                plan_latency_s=step.plan_latency_s,
                trace_id=step.trace_id,
                events=events,
                drafts=replayed.drafts,
                plan_text=render(replayed, show_plan=True),
                reproduces=replayed.is_identical if step.plan is not None else None,
            )
        )
    return records
