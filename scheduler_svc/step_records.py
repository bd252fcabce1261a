"""The step-record format, written by a worker with `--record-steps FILE` and read by `hybridserve
replay` and `hybridserve timeline`: one module with the writer and the reader, so the three agree.

One JSON object per line, each one engine step:

    {"step_index": N, "request": base64(PlanStepRequest), "plan": base64(PlanStepResponse),
     "plan_latency_s": float, "time_unix_s": float,
     "wall_s": float, "trace_id": hex, "request_events": [...],   # optional, for the timeline
     "drafts": [[request_id, drafted, accepted], ...]}            # optional: speculation's verifications

`request` and `plan` may also be written in their JSON form (an object, as
google.protobuf.json_format writes it); `plan` may be missing (the reader replays it then). Both
messages are serialized deterministically, so a replay that re-plans the request can compare its plan
with the recorded one byte for byte.

The optional keys are what a timeline needs beyond the plan: how long the step ran (`wall_s`, so it
started at `time_unix_s - wall_s`), the trace of its step span (`trace_id`), and the request events
seen since the previous recorded line (`request_events`: "queued" with the arrival and sizes,
"finished" with the first token, the finish and its reason; times in Unix seconds). Events ride on
step lines rather than lines of their own, so every line stays a step record any reader takes.

The writer builds lines on the caller's thread and writes them on a thread of its own, each batch
flushed as written, so a crash loses at most the lines not written yet: a write (and its flush)
gives up the GIL, and taking it back beside a worker's stream threads cost the engine thread about
0.8 ms per step at 32 running requests.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from google.protobuf import json_format
from google.protobuf.message import DecodeError, Message

from hybridserve.errors import InvalidArgumentError
from hybridserve.v1 import scheduler_pb2 as pb
from scheduler_svc import convert
from scheduler_svc.core import StepInput, StepPlan

M = TypeVar("M", bound=Message)


@dataclass(frozen=True, slots=True)
class RequestEvent:
    """A request's event as a line carries it. The writer is handed times in monotonic seconds and
    writes them as Unix seconds (`shifted`); the reader gives Unix seconds."""

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
    max_tokens: int = 0  # what the request asked for ("queued" only)
    priority: int = 0  # smaller is served first ("queued" only)

    def shifted(self, offset_s: float) -> RequestEvent:
        """The event with every time moved by offset_s (monotonic -> Unix), to the microsecond."""

        def move(t: float | None) -> float | None:
            return None if t is None else round(t + offset_s, 6)

        return dataclasses.replace(
            self,
            arrival_unix_s=move(self.arrival_unix_s),
            first_token_unix_s=move(self.first_token_unix_s),
            finish_unix_s=move(self.finish_unix_s),
        )

    def to_json(self) -> dict[str, Any]:
        if self.kind == "queued":
            return {
                "event": "queued",
                "request_id": self.request_id,
                "trace_id": self.trace_id,
                "arrival_unix_s": self.arrival_unix_s,
                "prompt_tokens": self.prompt_tokens,
                "max_tokens": self.max_tokens,
                "priority": self.priority,
            }
        return {
            "event": self.kind,
            "request_id": self.request_id,
            "trace_id": self.trace_id,
            "reason": self.reason,
            "arrival_unix_s": self.arrival_unix_s,
            "first_token_unix_s": self.first_token_unix_s,
            "finish_unix_s": self.finish_unix_s,
            "prompt_tokens": self.prompt_tokens,
            "cached_tokens": self.cached_tokens,
            "completion_tokens": self.completion_tokens,
        }

    @staticmethod
    def from_json(raw: dict[str, Any]) -> RequestEvent:
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
            max_tokens=int(raw.get("max_tokens") or 0),
            priority=int(raw.get("priority") or 0),
        )


def _float(value: Any) -> float | None:
    return None if value is None else float(value)


# --- writing ---------------------------------------------------------------------------------------


def encode_step(step_input: StepInput) -> bytes:
    """The request as the worker sends it (columns: a tenth of the per-request messages' work)."""
    return convert.step_to_pb_columns(step_input).SerializeToString(deterministic=True)


def encode_plan(plan: StepPlan) -> bytes:
    return convert.plan_to_pb(plan).SerializeToString(deterministic=True)


def step_line(
    step_index: int,
    step_input: StepInput,
    plan: StepPlan,
    plan_latency_s: float,
    wall_s: float | None = None,
    trace_id: str = "",
    drafts: Sequence[tuple[str, int, int]] = (),
) -> tuple[dict[str, Any], bytes]:
    """One step's line without its request events, and the serialized PlanStepRequest (for a span
    event). Its time is now: the step's end, taken before encoding."""
    now_unix_s = time.time()
    request = encode_step(step_input)
    line: dict[str, Any] = {
        "step_index": step_index,
        "request": base64.b64encode(request).decode("ascii"),
        "plan": base64.b64encode(encode_plan(plan)).decode("ascii"),
        "plan_latency_s": round(plan_latency_s, 6),
        "time_unix_s": round(now_unix_s, 6),
    }
    if wall_s is not None:
        line["wall_s"] = round(wall_s, 6)
    if trace_id:
        line["trace_id"] = trace_id
    if drafts:
        line["drafts"] = [[rid, drafted, accepted] for rid, drafted, accepted in drafts]
    return line, request


class StepRecordWriter:
    """Appends lines to a file on a writer thread of its own, in the order `write` was called."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self._closed = False
        self.num_written = 0  # lines accepted by `write` (queued or on disk)
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()  # None: no more lines
        self._writer = threading.Thread(target=self._write_lines, name="step-recorder", daemon=True)
        self._writer.start()

    def write(self, line: dict[str, Any], events: Sequence[RequestEvent] = ()) -> None:
        """Queues one line; `events` (times in monotonic seconds) ride on it as Unix seconds. A line
        written after close() is dropped."""
        if events:
            offset_s = time.time() - time.monotonic()
            line = {**line, "request_events": [e.shifted(offset_s).to_json() for e in events]}
        text = json.dumps(line, separators=(",", ":"))
        with self._lock:
            if not self._closed:
                self._lines.put(text)
                self.num_written += 1

    def _write_lines(self) -> None:
        """The writer thread: the queued lines, in order, each batch flushed, until close()."""
        while (text := self._lines.get()) is not None:
            batch = [text]
            while True:
                try:
                    more = self._lines.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._lines.put(None)  # seen after this batch
                    break
                batch.append(more)
            self._file.write("\n".join(batch) + "\n")
            self._file.flush()

    def close(self) -> None:
        """Writes the queued lines and closes the file; later lines are dropped."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._lines.put(None)
        self._writer.join()
        self._file.close()


# --- reading ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RecordedStep:
    """One line of a step-record file, decoded."""

    step_index: int  # the engine's step counter
    request: pb.PlanStepRequest  # what the scheduler was sent
    plan: pb.PlanStepResponse | None  # the plan it got; None when the line has none
    raw: dict[str, Any]  # the whole JSON object, for the optional keys

    @property
    def end_unix_s(self) -> float:
        """Unix seconds when the step was recorded (its end)."""
        return float(self.raw["time_unix_s"])

    @property
    def wall_s(self) -> float | None:
        """The whole step, seconds; None in files from older recorders."""
        return _float(self.raw.get("wall_s"))

    @property
    def plan_latency_s(self) -> float:
        return float(self.raw.get("plan_latency_s") or 0.0)

    @property
    def trace_id(self) -> str:
        return str(self.raw.get("trace_id") or "")

    def events(self) -> tuple[RequestEvent, ...]:
        return tuple(RequestEvent.from_json(e) for e in self.raw.get("request_events") or ())

    def drafts(self) -> tuple[tuple[str, int, int], ...]:
        """(request id, draft tokens verified, accepted) of each drafted row the step verified."""
        return tuple((str(rid), int(drafted), int(accepted)) for rid, drafted, accepted in self.raw.get("drafts") or ())


def _decode(value: Any, cls: type[M]) -> M:
    """A message from base64 bytes (a string) or its JSON form (an object)."""
    if isinstance(value, dict):
        return json_format.ParseDict(value, cls())
    return cls.FromString(base64.b64decode(value))


def read_steps(path: Path) -> Iterator[RecordedStep]:
    """Every step of the file in file order (blank lines skipped); InvalidArgumentError naming the
    line on one that is not a step record."""
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                raw = json.loads(line)
                request = _decode(raw["request"], pb.PlanStepRequest)
                plan = _decode(raw["plan"], pb.PlanStepResponse) if raw.get("plan") is not None else None
            except (ValueError, KeyError, DecodeError, json_format.ParseError) as exc:
                raise InvalidArgumentError(f"{path}:{number}: not a step record: {type(exc).__name__}: {exc}") from None
            yield RecordedStep(int(raw.get("step_index", request.step_index)), request, plan, raw)


def read_records(path: Path) -> Iterator[tuple[int, pb.PlanStepRequest, pb.PlanStepResponse | None]]:
    """(step index, scheduler input, recorded plan or None) of every step, in file order."""
    for step in read_steps(path):
        yield step.step_index, step.request, step.plan
