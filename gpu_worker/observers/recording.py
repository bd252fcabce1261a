"""Step recording: a sample of the steps' scheduler input and plan, with the requests' events, to a
JSONL file for `hybridserve replay` and `hybridserve timeline`. The format, its writer and its reader
are scheduler_svc/step_records.py; this module decides what goes in it.

`StepRecorder` samples the steps (seeded, so runs repeat) and keeps the request events it is told of
until the next sampled line. `RecordingObserver` feeds it from the engine's records. The engine
reports the requests a step ended after the step itself, so a step's line is held until the next step
(or close) and written then, carrying those requests' "finished" events."""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context

from gpu_worker.engine.observer import EngineObserver
from gpu_worker.engine.records import FirstToken, RequestFinished, RequestQueued, StepRecord
from scheduler_svc.core import StepInput, StepPlan
from scheduler_svc.step_records import RequestEvent, StepRecordWriter, step_line


def trace_id_of(context: object | None = None) -> str:
    """The 32-hex trace id of the span in `context` (the current one when None), or ""."""
    span = trace.get_current_span(context if isinstance(context, Context) else None)
    span_context = span.get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else ""


def queued_event(event: RequestQueued, trace_id: str) -> RequestEvent:
    """A "queued" request event (arrival and sizes), its times still monotonic seconds."""
    return RequestEvent(
        "queued", event.request_id, trace_id, event.arrival_time, None, None, "", event.num_prompt_tokens, 0, 0,
        max_tokens=event.max_tokens, priority=event.priority,
    )  # fmt: skip


def finished_event(event: RequestFinished, trace_id: str, first_token_time: float | None) -> RequestEvent:
    """A "finished" request event (first token, finish, reason, usage), its times still monotonic seconds."""
    return RequestEvent(
        "finished", event.request_id, trace_id, event.arrival_time, first_token_time, event.finish_time,
        event.reason.value, event.num_prompt_tokens, event.num_output_tokens, event.num_cached_tokens,
    )  # fmt: skip


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
        self._writer = StepRecordWriter(self.path)
        self._lock = threading.Lock()
        self._pending: list[RequestEvent] = []  # request events since the last written line
        self._trace_ids: dict[str, str] = {}  # request id -> trace id, from queueing to finish
        self._first_token: dict[str, float] = {}  # request id -> first token time (monotonic s)

    @property
    def num_recorded(self) -> int:
        return self._writer.num_written

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
        self, step_index: int, step_input: StepInput, plan: StepPlan, plan_latency_s: float,
        wall_s: float | None = None, drafts: Sequence[tuple[str, int, int]] = (),
    ) -> tuple[dict[str, Any], bytes]:  # fmt: skip
        """One step's line without its request events, and the serialized PlanStepRequest. Called
        inside the step's span, whose trace id goes on the line; `write` adds the events. `drafts`:
        the step's verifications (StepRecord.drafts)."""
        return step_line(step_index, step_input, plan, plan_latency_s, wall_s, trace_id_of(), drafts)

    def write(self, line: dict[str, Any]) -> None:
        """Writes a prepared line with the request events seen since the last one."""
        with self._lock:
            pending, self._pending = self._pending, []
        self._writer.write(line, pending)

    def close(self) -> None:
        """Writes the queued lines and closes the file; later lines are dropped."""
        self._writer.close()


class RecordingObserver(EngineObserver):
    def __init__(self, recorder: StepRecorder) -> None:
        self.recorder = recorder
        self._last: tuple[int, bytes] | None = None  # (step index, serialized PlanStepRequest)
        self._held: dict[str, Any] | None = None  # the last step's line, written at the next step

    def request_queued(self, event: RequestQueued) -> None:
        self.recorder.request_queued(event)

    def request_first_token(self, event: FirstToken) -> None:
        self.recorder.request_first_token(event)

    def request_finished(self, event: RequestFinished) -> None:
        self.recorder.request_finished(event)

    def step_finished(self, record: StepRecord) -> None:
        self._write_held()
        self._last = None
        if record.step_input is not None and self.recorder.should_record():
            self._held, sent = self.recorder.prepare(
                record.step_index, record.step_input, record.plan, record.plan_latency_s, record.wall_s, record.drafts
            )
            self._last = (record.step_index, sent)

    def _write_held(self) -> None:
        if self._held is not None:
            self.recorder.write(self._held)
            self._held = None

    def recorded_input(self, step_index: int) -> bytes | None:
        """The serialized scheduler input of step `step_index` if that step was just recorded."""
        if self._last is None or self._last[0] != step_index:
            return None
        return self._last[1]

    def close(self) -> None:
        self._write_held()
        self.recorder.close()
