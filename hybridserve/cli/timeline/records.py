"""Reads a `--record-steps` JSONL file into step records, each with its replay.

The protobuf decoding and the replay are `scheduler_svc.replay`'s own (`read_records`,
`replay_one`, `render`), so the plan text a step shows is byte for byte what
`hybridserve replay FILE --step N` prints for it. The optional keys a newer recorder writes
(`wall_s`, `trace_id`, `request_events`, see gpu_worker/step_recorder.py) are read here; files
without them still load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridserve.errors import InvalidArgumentError
from scheduler_svc import convert
from scheduler_svc.core import StepInput, StepPlan
from scheduler_svc.replay import Replayed, read_records, render, replay_one


@dataclass(frozen=True, slots=True)
class RequestEvent:
    kind: str  # "queued" (entered the queue) or "finished"
    request_id: str
    trace_id: str  # 32 hex digits of the request span's trace, "" when not traced
    arrival_unix_s: float | None  # Unix seconds
    first_token_unix_s: float | None  # Unix seconds; None before the first token (or queued)
    finish_unix_s: float | None  # Unix seconds; None for "queued"
    reason: str  # finish reason ("length", "stop", "abort", "error"); "" for "queued"
    prompt_tokens: int
    completion_tokens: int  # tokens generated ("finished" only)
    cached_tokens: int  # prompt tokens served from the prefix cache ("finished" only)


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


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


def event_from_json(raw: dict[str, Any]) -> RequestEvent:
    return RequestEvent(
        kind=str(raw["event"]),
        request_id=str(raw["request_id"]),
        trace_id=str(raw.get("trace_id") or ""),
        arrival_unix_s=_float(raw.get("arrival_unix_s")),
        first_token_unix_s=_float(raw.get("first_token_unix_s")),
        finish_unix_s=_float(raw.get("finish_unix_s")),
        reason=str(raw.get("reason") or ""),
        prompt_tokens=int(raw.get("prompt_tokens") or 0),
        completion_tokens=int(raw.get("completion_tokens") or 0),
        cached_tokens=int(raw.get("cached_tokens") or 0),
    )


def _extras(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of the file's non-blank lines, in the order read_records yields them."""
    with path.open(encoding="utf-8") as lines:
        return [json.loads(line) for line in lines if line.strip()]


def load_records(path: Path) -> list[StepRecord]:
    """Every step of the file in file order, replayed; InvalidArgumentError on a bad file."""
    decoded = list(read_records(path))  # raises InvalidArgumentError naming the bad line
    extras = _extras(path)
    records = []
    for (step_index, request, recorded), raw in zip(decoded, extras, strict=True):
        try:
            events = tuple(event_from_json(e) for e in raw.get("request_events") or ())
            end_unix_s = float(raw["time_unix_s"])
        except (KeyError, TypeError, ValueError) as exc:
            raise InvalidArgumentError(f"{path}: step {step_index}: bad timeline fields: {exc!r}") from None
        replayed = Replayed(step_index, recorded, replay_one(request, {}))
        executed = recorded if recorded is not None else replayed.replayed
        records.append(
            StepRecord(
                step_index=step_index,
                step_input=convert.step_from_pb(request),
                plan=convert.plan_from_pb(executed),
                end_unix_s=end_unix_s,
                wall_s=_float(raw.get("wall_s")),
                plan_latency_s=float(raw.get("plan_latency_s") or 0.0),
                trace_id=str(raw.get("trace_id") or ""),
                events=events,
                plan_text=render(replayed, show_plan=True),
                reproduces=replayed.is_identical if recorded is not None else None,
            )
        )
    return records
