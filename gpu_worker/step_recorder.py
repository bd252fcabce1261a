"""Records each step's exact scheduler input and the plan it got, one JSON object per line, for
`hybridserve replay` and `hybridserve timeline`:

    {"step_index": N, "request": base64(PlanStepRequest), "plan": base64(PlanStepResponse),
     "plan_latency_s": float, "time_unix_s": float,
     "wall_s": float, "trace_id": hex, "request_events": [...]}   # optional, for the timeline

Both messages are serialized deterministically, so a replay that re-plans the request can compare
its plan with the recorded one byte for byte. Lines are built on the engine thread and written by a
writer thread, each flushed as written, so a crash loses at most the lines not written yet: a write
(and its flush) gives up the GIL, and taking it back beside a worker's stream threads cost the engine
thread about 0.8 ms per step at 32 running requests.

The optional keys are what a timeline needs beyond the plan: how long the step ran (`wall_s`, so it
started at `time_unix_s - wall_s`), the trace of its step span (`trace_id`, when tracing), and the
request events seen since the previous recorded line (`request_events`: "queued" with the arrival,
"finished" with the first token, the finish and its reason; times in Unix seconds). Events ride on
step lines rather than lines of their own, so every line stays a step record that any `replay`
reads; events after the last recorded step are not written. Preemptions are in the plans.
"""

from __future__ import annotations

import base64
import json
import queue
import random
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentelemetry import trace
from opentelemetry.context import Context

from scheduler_svc import convert
from scheduler_svc.core import StepInput, StepPlan

if TYPE_CHECKING:
    from gpu_worker.engine.records import FirstToken, RequestFinished, RequestQueued


def encode_step(step_input: StepInput) -> bytes:
    """The request as the worker sends it (columns: a tenth of the per-request messages' work)."""
    return convert.step_to_pb_columns(step_input).SerializeToString(deterministic=True)


def encode_plan(plan: StepPlan) -> bytes:
    return convert.plan_to_pb(plan).SerializeToString(deterministic=True)


def trace_id_of(context: object | None = None) -> str:
    """The 32-hex trace id of the span in `context` (the current one when None), or ""."""
    span = trace.get_current_span(context if isinstance(context, Context) else None)
    span_context = span.get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else ""


def _unix_s(monotonic_s: float | None, offset_s: float) -> float | None:
    return None if monotonic_s is None else round(monotonic_s + offset_s, 6)


def queued_event(event: RequestQueued, trace_id: str) -> dict[str, Any]:
    """A "queued" request event (arrival and sizes), its times still monotonic seconds."""
    return {
        "event": "queued",
        "request_id": event.request_id,
        "trace_id": trace_id,
        "arrival_unix_s": event.arrival_time,
        "prompt_tokens": event.num_prompt_tokens,
        "max_tokens": event.max_tokens,
        "priority": event.priority,
    }


def finished_event(event: RequestFinished, trace_id: str, first_token_time: float | None) -> dict[str, Any]:
    """A "finished" request event (first token, finish, reason, usage), its times still monotonic seconds."""
    return {
        "event": "finished",
        "request_id": event.request_id,
        "trace_id": trace_id,
        "reason": event.reason.value,
        "arrival_unix_s": event.arrival_time,
        "first_token_unix_s": first_token_time,
        "finish_unix_s": event.finish_time,
        "prompt_tokens": event.num_prompt_tokens,
        "cached_tokens": event.num_cached_tokens,
        "completion_tokens": event.num_output_tokens,
    }


def to_unix(event: dict[str, Any], offset_s: float) -> dict[str, Any]:
    """The event with its monotonic times (keys ending in `_unix_s`) turned into Unix seconds."""
    return {k: _unix_s(v, offset_s) if k.endswith("_unix_s") else v for k, v in event.items()}


class StepRecorder:
    """Writes a sample of the steps (`sample_rate` 1.0 = every step, seeded so runs repeat).

    `request_queued`, `request_first_token` and `request_finished` take the engine's request records;
    they keep a small event (under a lock: queueing happens on the submitting thread), written with the
    next sampled step. The request's trace id is read where it is queued (inside its RPC's span). With
    `sample_rate` 0 they keep nothing.
    """

    def __init__(self, path: Path | str, sample_rate: float = 1.0, seed: int = 0) -> None:
        if not 0.0 <= sample_rate <= 1.0:
            raise ValueError(f"--record-sample-rate must be within [0, 1], got {sample_rate}")
        self.path = Path(path)
        self.sample_rate = sample_rate
        self._rng = random.Random(seed)
        self._file = self.path.open("a", encoding="utf-8")
        self._lock = threading.Lock()
        self._pending: list[dict[str, Any]] = []  # request events since the last written line
        self._trace_ids: dict[str, str] = {}  # request id -> trace id, from queueing to finish
        self._first_token: dict[str, float] = {}  # request id -> first token time (monotonic s)
        self.num_recorded = 0
        self._closed = False
        self._lines: queue.SimpleQueue[str | None] = queue.SimpleQueue()  # None: no more lines
        self._writer = threading.Thread(target=self._write_lines, name="step-recorder", daemon=True)
        self._writer.start()

    def should_record(self) -> bool:
        return self.sample_rate >= 1.0 or (self.sample_rate > 0.0 and self._rng.random() < self.sample_rate)

    def request_queued(self, event: RequestQueued) -> None:
        if self.sample_rate > 0.0:
            trace_id = trace_id_of()
            with self._lock:
                self._trace_ids[event.request_id] = trace_id
                self._pending.append(queued_event(event, trace_id))

    def request_first_token(self, event: FirstToken) -> None:
        if self.sample_rate > 0.0:
            with self._lock:
                self._first_token[event.request_id] = event.first_token_time

    def request_finished(self, event: RequestFinished) -> None:
        if self.sample_rate > 0.0:
            with self._lock:
                trace_id = self._trace_ids.pop(event.request_id, "")
                first = self._first_token.pop(event.request_id, None)
                self._pending.append(finished_event(event, trace_id, first))

    def record(
        self, step_index: int, step_input: StepInput, plan: StepPlan, plan_latency_s: float, wall_s: float | None = None
    ) -> bytes:
        """Writes one line; returns the serialized PlanStepRequest (for a span event). Called inside
        the step's span (the current span), whose trace id goes on the line."""
        line, request = self.prepare(step_index, step_input, plan, plan_latency_s, wall_s)
        self.write(line)
        return request

    def prepare(
        self, step_index: int, step_input: StepInput, plan: StepPlan, plan_latency_s: float, wall_s: float | None = None
    ) -> tuple[dict[str, Any], bytes]:
        """One step's line without its request events, and the serialized PlanStepRequest. Called
        inside the step's span, whose trace id goes on the line; `write` adds the events."""
        now_unix_s = time.time()  # first: the step's end, not the end of encoding it
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
        trace_id = trace_id_of()
        if trace_id:
            line["trace_id"] = trace_id
        return line, request

    def write(self, line: dict[str, Any]) -> None:
        """Writes a prepared line with the request events seen since the last one."""
        with self._lock:
            pending, self._pending = self._pending, []
        if pending:
            offset_s = time.time() - time.monotonic()
            line = {**line, "request_events": [to_unix(event, offset_s) for event in pending]}
        text = json.dumps(line, separators=(",", ":"))
        with self._lock:
            if not self._closed:
                self._lines.put(text)
                self.num_recorded += 1

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
